"""torch ops lowered to JAX by torchshard where torchax's own lowering loses shardings or time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshard._errors import ShardingError


def gather_along_axis(input, dim, index, *, sparse_grad=False):
    """``aten.gather`` as ``take_along_axis``: a batched gather that GSPMD keeps sharded.

    torchax's own version indexes with full coordinate grids, which the partitioner cannot split,
    so ``cross_entropy`` on a batch-sharded step all-gathers the batch.
    """
    if input.ndim == 0:
        return jnp.broadcast_to(input, index.shape)
    dim %= input.ndim
    # torch lets index be smaller than input in the other dims: only that corner is read.
    corner = tuple(slice(None) if d == dim else slice(0, index.shape[d]) for d in range(input.ndim))
    return jnp.take_along_axis(input[corner], index, axis=dim)


def nll_loss_forward(input, target, weight, reduction, ignore_index):
    """``aten.nll_loss_forward`` as one fused pick-and-reduce.

    torch's decomposition (what torchax runs) adds a separate integer reduction of the valid
    targets and a scatter in the backward: about 8 % of a data-parallel MLP step here.
    """
    batched = input.ndim == 2
    input, target = (input, target) if batched else (input[None], target[None])
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    picked = jnp.take_along_axis(input, safe[:, None], axis=1)[:, 0]
    w = valid.astype(input.dtype) if weight is None else jnp.where(valid, weight[safe], 0).astype(input.dtype)
    losses = -picked * w
    total = w.sum()
    if reduction == 0:
        return (losses if batched else losses[0]), total
    return (losses.sum() / total if reduction == 1 else losses.sum()), total


def matmul(x, y):
    """``torch.matmul`` as ``jnp.matmul``.

    torch's version decomposes batched operands (e.g. [batch, heads, seq, dim]) into reshapes
    around ``bmm`` that merge the batch and head dims; GSPMD then gathers heads that a
    tensor-parallel attention had split.
    """
    return jnp.matmul(x, y)


def jax_lowerings() -> dict[Any, Callable[..., Any]]:
    """torch callables → JAX implementations (they take and return jax arrays)."""
    return {
        torch.ops.aten.gather: gather_along_axis,
        torch.ops.aten.nll_loss_forward: nll_loss_forward,
        torch.matmul: matmul,
        torch.Tensor.matmul: matmul,
        torch.Tensor.__matmul__: matmul,
    }


def attention_jax(query, key, value, attn_mask, is_causal, scale):
    """[batch, heads, seq, dim] attention by ``jax.nn.dot_product_attention`` (grouped KV heads too)."""
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (query, key, value))
    mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None, None] if is_causal else None
    bias = None
    if attn_mask is not None:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + attn_mask.shape)
        if attn_mask.dtype == jnp.bool_:
            mask = attn_mask if mask is None else mask & attn_mask
        else:
            bias = attn_mask.astype(q.dtype)
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale)
    return jnp.swapaxes(out, 1, 2)


ATTENTION_OPS = (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention)


def attention(reference: Callable[..., Any], call_jax: Callable[..., Any]) -> Callable[..., Any]:
    """``scaled_dot_product_attention`` that keeps heads sharded; dropout and odd ranks use ``reference``.

    torchax's version repeats grouped KV heads and multiplies through reshapes that make GSPMD
    gather the heads a tensor-parallel attention had split over the mesh.

    Args:
        reference: torchax's own implementation (a torch-level op that takes ``env=``).
        call_jax: calls a JAX function on torch tensors (torchax's ``interop.call_jax``).
    """

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, env=None):
        if dropout_p > 0 or query.ndim != 4 or (query.shape[1] != key.shape[1] and not enable_gqa):
            return reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env=env)
        return call_jax(attention_jax, query, key, value, attn_mask, is_causal, scale)

    return sdpa


# matrix products whose operands torch requires to share a dtype; torchax would silently promote an
# integer batch fed to a float model (positions of the two matrix operands in the op's arguments)
SAME_DTYPE = {
    torch.nn.functional.linear: ("F.linear", (0, 1)),
    torch.ops.aten.mm: ("mm", (0, 1)),
    torch.ops.aten.bmm: ("bmm", (0, 1)),
    torch.ops.aten.addmm: ("addmm", (1, 2)),
    torch.matmul: ("matmul", (0, 1)),
    torch.Tensor.matmul: ("matmul", (0, 1)),
    torch.Tensor.__matmul__: ("@", (0, 1)),
}


def same_dtype_kind(name: str, positions: tuple[int, int], impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` (a JAX lowering) that refuses an integer operand next to a floating one, as torch does."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        a, b = (args[i] for i in positions)
        if jnp.issubdtype(a.dtype, jnp.floating) != jnp.issubdtype(b.dtype, jnp.floating):
            raise ShardingError(
                f"{name} of a {a.dtype}{list(a.shape)} and a {b.dtype}{list(b.shape)} operand: torch refuses mixed "
                f"integer/floating matrix products (JAX would promote silently); cast the batch, e.g. x.float()"
            )
        return impl(*args, **kwargs)

    return guarded
