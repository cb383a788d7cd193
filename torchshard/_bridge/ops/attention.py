"""``scaled_dot_product_attention`` in torch's layout that keeps heads sharded, tiled by `flash` (no saved scores)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshard._bridge.loaded import Environment, interop
from torchshard._bridge.ops import flash
from torchshard._bridge.registry import register


def _grouped(query: jax.Array, kv_heads: int, scale: float | None) -> jax.Array:
    """[batch, heads, seq, dim] queries, scaled, as [batch, kv_heads, group, seq, dim].

    Head ``n`` reads kv head ``n // group``, as torch's ``enable_gqa`` does.
    """
    b, n, s, h = query.shape
    scale = h**-0.5 if scale is None else scale
    return (query * jnp.asarray(scale, query.dtype)).reshape(b, kv_heads, n // kv_heads, s, h)


def _as_grouped_mask(mask: jax.Array, heads: int, kv_heads: int) -> jax.Array:
    """A mask broadcastable to [batch, heads, s, t] as one broadcastable to [batch, kv_heads, group, s, t]."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    group = (kv_heads, heads // kv_heads) if mask.shape[1] == heads else (1, 1)
    return mask.reshape(mask.shape[0], *group, *mask.shape[2:])


def attention_jax(query, key, value, attn_mask, is_causal, scale, *, tiles: tuple[int, int] | None = None):
    """[batch, heads, seq, dim] attention in torch's layout (grouped KV heads too): see `flash.attend`."""
    b, n, s = query.shape[:3]
    kv_heads, t = key.shape[1], key.shape[2]
    q = _grouped(query, kv_heads, scale)
    mask = bias = None
    if attn_mask is not None:
        grouped = _as_grouped_mask(attn_mask, n, kv_heads)
        mask, bias = (grouped, None) if grouped.dtype == jnp.bool_ else (None, grouped)
    rows, keys = tiles or (flash.tile_size(s), flash.tile_size(t))
    tiling = flash.Tiling(rows, keys, is_causal)
    return flash.attend(tiling, q, key, value, mask, bias).reshape(b, n, s, value.shape[-1])


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
        grouped = query.ndim == 4 and key.ndim == 4 and query.shape[1] % key.shape[1] == 0
        empty = grouped and (query.shape[2] == 0 or key.shape[2] == 0)  # no tile to fold: torchax's own op
        if dropout_p > 0 or not grouped or empty or (query.shape[1] != key.shape[1] and not enable_gqa):
            return reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env=env)
        return call_jax(attention_jax, query, key, value, attn_mask, is_causal, scale)

    return sdpa


def install(tx: Environment) -> None:
    """Registers the lowering in ``tx``, torchax's own kept as the fallback."""
    for op in ATTENTION_OPS:
        reference = tx._ops[op].func  # private: torchax's own lowering, kept as the fallback
        register(tx, op, attention(reference, interop.call_jax), jax_function=False, needs_env=True)
