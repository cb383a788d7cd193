"""``aten.embedding`` whose padding row gets no gradient without an indexed set GSPMD misapplies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchshard._bridge.loaded import Environment
from torchshard._bridge.registry import register


def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """``aten.embedding``: rows of ``weight``; no gradient reaches row ``padding_idx`` (≥ 0; -1: none).

    torchax zeroes the padding row of the weight's tangent with an indexed set, which GSPMD
    applies at local row ``padding_idx`` of *every* shard when the table is split over its rows
    (FSDP): the first row of each shard then never trained. Cutting the gradient of the looked-up
    padding positions instead is the same gradient with no index into the table.
    """
    if scale_grad_by_freq:
        raise NotImplementedError("embedding(scale_grad_by_freq=True) has no lowering; scale the loss instead")
    out = jnp.take(weight, indices, axis=0)
    if padding_idx < 0:
        return out
    keep = (indices != padding_idx)[..., None]
    return jnp.where(keep, out, jax.lax.stop_gradient(out))


def install(tx: Environment) -> None:
    """Registers the lowering in ``tx``."""
    register(tx, torch.ops.aten.embedding, embedding, jax_function=True, needs_env=False)
