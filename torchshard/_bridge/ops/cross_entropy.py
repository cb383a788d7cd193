"""Class-index ``F.cross_entropy`` fused: ``logsumexp − logits[target]`` with a ``softmax − one_hot`` gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshard._bridge.loaded import Environment, interop
from torchshard._bridge.ops import tokens
from torchshard._bridge.ops.loss_edges import mean_over_valid, out_of_range_nan
from torchshard._bridge.registry import register

CROSS_ENTROPY_OPS = (torch.nn.functional.cross_entropy,)
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def cross_entropy_jax(logits, target, ignore_index, reduction, float32_out=False):
    """Class-index cross entropy of ``[N, C]`` logits, reduced by ``"mean"`` (over valid rows) or ``"sum"``.

    Computed in float32 at least, returned in the logits' dtype (``float32_out``: in float32).
    One pass over the logits: ``logsumexp − logits[target]``, the pick a compare with an iota.
    Its gradient, ``softmax − one_hot``, is elementwise; torch's decomposition (log_softmax, then
    a gather) differentiates into a zero ``[N, C]`` buffer plus a scatter-add, and under FSDP
    re-shards the vocabulary-sharded logits with an all-to-all (15.6 MiB per device per Llama step).
    """
    # the flat tokens' order does not matter to the loss: under context parallelism they stay sharded
    logits, target = tokens.constrain_flat(logits), tokens.constrain_flat(target)
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    valid = target != ignore_index
    hit = jax.lax.broadcasted_iota(target.dtype, x.shape, 1) == target[:, None]
    picked = jnp.sum(jnp.where(hit, x, 0), axis=1)
    loss = jnp.sum(jnp.where(valid, jax.nn.logsumexp(x, axis=1) - picked, 0))
    # a label outside the classes: nan (eager torch raises); every row ignored: a nan mean with 0 gradients
    loss = mean_over_valid(loss * out_of_range_nan(target, ignore_index, x.shape[1]), valid, reduction)
    return loss if float32_out else loss.astype(logits.dtype)


def cross_entropy(call_jax: Callable[..., Any]) -> Callable[..., Any]:
    """``F.cross_entropy`` through `cross_entropy_jax` for [N, C] logits with class targets and no class weights.

    Class weights, label smoothing, probability targets, extra dims and ``reduction="none"`` run
    torch's own decomposition, as before. Under autocast the loss is float32 (torch's policy).

    Args:
        call_jax: calls a JAX function on torch tensors (torchax's ``interop.call_jax``).
    """

    def fused(
        input,
        target,
        weight=None,
        size_average=None,
        ignore_index=-100,
        reduce=None,
        reduction="mean",
        label_smoothing=0.0,
        env=None,
    ):
        if size_average is not None or reduce is not None:
            reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
        simple = weight is None and label_smoothing == 0.0 and reduction in ("mean", "sum")
        if not (simple and input.ndim == 2 and target.ndim == 1 and not target.dtype.is_floating_point):
            return torch.ops.aten.cross_entropy_loss(
                input, target, weight, _REDUCTIONS[reduction], ignore_index, label_smoothing
            )
        autocast = env is not None and env.param.autocast_dtype is not None
        return call_jax(cross_entropy_jax, input, target, ignore_index, reduction, autocast)

    return fused


def install(tx: Environment) -> None:
    """Registers the lowering in ``tx``."""
    for op in CROSS_ENTROPY_OPS:
        register(tx, op, cross_entropy(interop.call_jax), jax_function=False, needs_env=True)
