"""What `generate` refuses before any work: bad settings, ids, masks, lengths, and models it cannot decode exactly."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchshard._generate.decode_cache import layer_kinds
from torchshard._generate.decoders import is_hf_causal_lm, max_positions

ACCEPTS = (
    "generate takes a transformers causal LM (an AutoModelForCausalLM class) or a module mapping integer "
    "token ids [batch, seq] to logits [batch, seq, vocab]"
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def setting_problems(max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any, eos: Any, seed: Any) -> list[str]:
    """What is wrong with the decoding settings, each with its fix."""
    problems = []
    if not _is_int(max_new_tokens) or max_new_tokens <= 0:
        problems.append(f"max_new_tokens={max_new_tokens!r}: generate at least one token (a positive int)")
    if not _is_number(temperature) or not temperature >= 0:
        problems.append(f"temperature={temperature!r}: 0 for greedy decoding, or a positive float to sample")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        problems.append(f"top_k={top_k!r}: keep the k ≥ 1 most likely tokens, or None")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        problems.append(f"top_p={top_p!r}: a probability in (0, 1], or None")
    ints = [eos] if _is_int(eos) else eos if isinstance(eos, Sequence) and not isinstance(eos, str) else None
    if eos is not None and (ints is None or not all(_is_int(e) for e in ints)):
        problems.append(f"eos_token_id={eos!r}: a token id, a list of them, or None")
    if not _is_int(seed):
        problems.append(f"seed={seed!r}: an int")
    return problems


def id_problems(input_ids: Any, attention_mask: Any) -> list[str]:
    """What is wrong with the ids' and the mask's types, shapes and padding."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.dtype.is_floating_point:
        shape = list(getattr(input_ids, "shape", []))
        return [f"input_ids is {type(input_ids).__name__} {shape}: pass integer token ids [batch, seq] as a tensor"]
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        return [f"input_ids has shape {list(input_ids.shape)}: pass at least one row of at least one token"]
    if attention_mask is None:
        return []
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
        shape = list(getattr(attention_mask, "shape", []))
        return [f"attention_mask {shape} must be a tensor shaped like input_ids {list(input_ids.shape)}"]
    mask = attention_mask.detach().cpu().to(torch.int64)
    if not bool(((mask == 0) | (mask == 1)).all()):
        return ["attention_mask holds values other than 0 and 1"]
    rows = [r for r in range(mask.shape[0]) if bool((mask[r, 1:] < mask[r, :-1]).any()) or not bool(mask[r, -1])]
    if rows:
        return [
            f"attention_mask rows {rows[:8]} are not left-padded (zeros only before the tokens, a token last); "
            f"pad prompts on the left (tokenizer.padding_side = 'left')"
        ]
    return []


def _input_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    """A transformers model's input embedding, else the module's first ``nn.Embedding`` (None without one)."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        with contextlib.suppress(NotImplementedError, AttributeError):  # models without one raise these
            found = get()
            if isinstance(found, torch.nn.Module):
                return found
    return next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)


def vocab_problems(model: torch.nn.Module, input_ids: torch.Tensor) -> list[str]:
    """Ids outside the input embedding's rows: eager ``nn.Embedding`` raises for them, so generate does too."""
    embedding = _input_embedding(model)
    vocab = getattr(embedding, "num_embeddings", None)
    if not isinstance(vocab, int):
        return []
    ids = input_ids.detach().cpu()
    bad = (ids < 0) | (ids >= vocab)
    if not bool(bad.any()):
        return []
    rows, cols = torch.nonzero(bad, as_tuple=True)
    values = sorted({int(v) for v in ids[bad].tolist()})
    return [
        f"input_ids holds {len(rows)} id(s) outside the vocabulary [0, {vocab}): {values[:8]} (first at row "
        f"{int(rows[0])}, position {int(cols[0])}); the input embedding {type(embedding).__name__} has {vocab} rows, "
        f"and eager torch raises for such ids: map them into [0, {vocab})"
    ]


def kind_problems(model: torch.nn.Module) -> tuple[tuple[str, ...], list[str]]:
    """A transformers model that is not a causal LM, or whose cache generate cannot decode over exactly;
    with a causal LM's layers' cache kinds."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return (), []
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        return (), [f"{name} is an encoder-decoder model, not a causal LM; {ACCEPTS}"]
    if not is_hf_causal_lm(model):
        return (), [f"{name} is not a causal LM (a transformers model without generate()); {ACCEPTS}"]
    return layer_kinds(model)


def length_problems(model: torch.nn.Module, hf: bool, prompt: int, new: Any, attention_mask: Any) -> list[str]:
    """A prompt and ``new`` tokens past the model's positions; a mask given to a model that reads ids alone."""
    problems = []
    limit = max_positions(model) if hf else None
    if limit is not None and _is_int(new) and prompt + new > limit:
        problems.append(
            f"the prompt ({prompt} tokens) and max_new_tokens={new} need {prompt + new} positions; the model and "
            f"its KV cache hold {limit} (config.max_position_embeddings): shorten the prompt or generate fewer"
        )
    if not hf and attention_mask is not None:
        problems.append(
            f"attention_mask: {type(model).__name__} is not a transformers causal LM, so generate feeds it ids "
            f"alone; pass unpadded prompts of one length"
        )
    return problems
