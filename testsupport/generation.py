"""Greedy generation's eager truth for the generate tests and the matrix: prompts, a left-padding mask, HF generate."""

from __future__ import annotations

import torch

NEW = 6  # new tokens each generation makes


def prompts(rows: int = 8, seq: int = 5, seed: int = 1) -> torch.Tensor:
    """``rows`` prompts of ``seq`` token ids."""
    return torch.randint(3, 128, (rows, seq), generator=torch.Generator().manual_seed(seed))


def left_padded(ids: torch.Tensor) -> torch.Tensor:
    """An attention mask over ``ids`` that pads rows 1 and 3 on the left (2 and 4 tokens)."""
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[3, :4] = 0
    return mask


def eager_generate(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """transformers' greedy generate of `NEW` tokens; ``kwargs`` go to it."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)
