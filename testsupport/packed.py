"""Packed documents for the context-parallel tests and the matrix: batches, the loss, AdamW on both sides."""

from __future__ import annotations

import optax
import torch
from torch import nn

from testsupport.helpers import torch_losses

SEQ, VOCAB = 256, 64
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.99), 1e-8, 0.01
SEQ_ROWS = [[100, 60, 96], [256], [30, 200, 26], [64, 64, 64, 64]]  # the training batches' rows (SEQ tokens)


def packed_positions(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """Position ids [rows, sum(lengths)]: each document counts from 0."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


def packed_loss(model, batch):
    """Cross entropy of ``(ids, labels, position ids)``, the model told where each document starts."""
    ids, labels, pos = batch
    # transformers detects packed rows only without a cache (its configs default to use_cache=True)
    out = model(input_ids=ids, position_ids=pos, use_cache=False)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def packed_batches(steps: int, rows: int = 4, seed: int = 0, lengths: list[list[int]] = SEQ_ROWS):
    """(ids, labels, position ids): labels are each document's next token, -100 at its last.

    Row ``r`` packs documents of ``lengths[r % len(lengths)]`` tokens."""
    pos = packed_positions([lengths[r % len(lengths)] for r in range(rows)])
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, pos.shape, generator=g)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = torch.where(pos[:, 1:] == 0, -100, ids[:, 1:])
        out.append((ids, labels, pos))
    return out


def adamw() -> optax.GradientTransformation:
    """The Trainer's AdamW, as `eager_losses`'."""
    return optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)


def eager_losses(model, data) -> list[float]:
    """Eager torch's losses of ``model`` trained on ``data`` with AdamW, as `adamw`."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return torch_losses(model, packed_loss, opt, data)
