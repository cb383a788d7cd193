"""``scaled_dot_product_attention`` in torch's layout that keeps heads sharded and skips masked causal blocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshard._bridge.loaded import Environment, interop
from torchshard._bridge.ops import flash
from torchshard._bridge.registry import register


def causal_blocks(seq: int) -> int:
    """Query blocks causal self-attention over ``seq`` positions is split into: at least 64 rows each, at most 8.

    Block ``i`` attends only to keys below the end of its own rows, so the dots and softmax cover
    ``(blocks + 1) / (2 * blocks)`` of the ``seq × seq`` square (5/8 with 4 blocks), as torch's
    CPU flash kernel gets from skipping masked tiles. Measured fwd+bwd on [16, 8, 256, 64]
    (XLA on CPU): 1 block 382 ms, 2 → 302, 4 → 270, 8 → 322; smaller blocks make dots too small.
    """
    for blocks in (8, 4, 2):
        if seq % blocks == 0 and seq // blocks >= 64:
            return blocks
    return 1


def _grouped(query: jax.Array, kv_heads: int, scale: float | None) -> jax.Array:
    """[batch, heads, seq, dim] queries, scaled, as [batch, kv_heads, group, seq, dim].

    Head ``n`` reads kv head ``n // group``, as torch's ``enable_gqa`` does.
    """
    b, n, s, h = query.shape
    scale = h**-0.5 if scale is None else scale
    return (query * jnp.asarray(scale, query.dtype)).reshape(b, kv_heads, n // kv_heads, s, h)


def _attend(
    q: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, bias: jax.Array | None
) -> jax.Array:
    """softmax(q·kᵀ + bias, masked)·v on [b, kv, group, s, dim] queries and [b, kv, t, dim] keys/values.

    (batch, kv head) are the leading batch dims of both dots and the contracting dim is minor,
    the layout XLA's batched dot kernels read in place: swapping to [batch, seq, heads, dim] for
    ``jax.nn.dot_product_attention`` cost 13 transposes per layer instead of 3. Grouped KV heads
    are read through the group dim instead of being repeated.
    """
    logits = jnp.einsum("bkgqh,bksh->bkgqs", q, key, preferred_element_type=jnp.float32)
    lowest = jnp.finfo(jnp.float32).min
    blocked = None  # query rows that may attend to no key: torch's SDPA gives them zeros, not a mean of values
    if bias is not None:
        bias = bias.astype(jnp.float32)
        blocked = jnp.all(bias == -jnp.inf, axis=-1, keepdims=True)
        logits = jnp.maximum(logits + bias, lowest)  # -inf → lowest: a fully blocked row stays finite under grad
    if mask is not None:
        logits = jnp.where(mask, logits, lowest)
        none = ~jnp.any(mask, axis=-1, keepdims=True)
        blocked = none if blocked is None else blocked | none
    probs = jax.nn.softmax(logits, axis=-1)
    if blocked is not None:  # e.g. the left padding of a batch of prompts
        probs = jnp.where(blocked, 0.0, probs)
    return jnp.einsum("bkgqs,bksh->bkgqh", probs.astype(value.dtype), value)


def _as_grouped_mask(mask: jax.Array, heads: int, kv_heads: int) -> jax.Array:
    """A mask broadcastable to [batch, heads, s, t] as one broadcastable to [batch, kv_heads, group, s, t]."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    group = (kv_heads, heads // kv_heads) if mask.shape[1] == heads else (1, 1)
    return mask.reshape(mask.shape[0], *group, *mask.shape[2:])


def _causal(rows: int, cols: int, offset: int = 0) -> jax.Array:
    """torch's causal mask (top-left aligned) for query rows ``offset...offset+rows`` against ``cols`` keys."""
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0) + offset
    return row >= jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)


def attention_jax(query, key, value, attn_mask, is_causal, scale, *, most: int = flash.TILE):
    """[batch, heads, seq, dim] attention in torch's layout (grouped KV heads too): see `flash.attend`."""
    b, n, s, h = query.shape
    kv_heads, t = key.shape[1], key.shape[2]
    q = _grouped(query, kv_heads, scale)
    mask = bias = None
    if attn_mask is not None:
        grouped = _as_grouped_mask(attn_mask, n, kv_heads)
        mask, bias = (grouped, None) if grouped.dtype == jnp.bool_ else (None, grouped)
    tiling = flash.Tiling(s // flash.tiles(s, most), t // flash.tiles(t, most), is_causal)
    return flash.attend(tiling, q, key, value, mask, bias).reshape(b, n, s, h)


def attention_materialised(query, key, value, attn_mask, is_causal, scale):
    """The former lowering (scores materialised, causal query blocks): kept to measure `attention_jax` against."""
    b, n, s, h = query.shape
    kv_heads, t = key.shape[1], key.shape[2]
    q = _grouped(query, kv_heads, scale)
    blocks = causal_blocks(s) if is_causal and attn_mask is None and s == t else 1
    if blocks > 1:
        return _causal_blocked(q, key, value, blocks).reshape(b, n, s, h)
    mask, bias = _causal(s, t) if is_causal else None, None
    if attn_mask is not None:
        grouped = _as_grouped_mask(attn_mask, n, kv_heads)
        if grouped.dtype == jnp.bool_:
            mask = grouped if mask is None else mask & grouped
        else:
            bias = grouped
    return _attend(q, key, value, mask, bias).reshape(b, n, s, h)


def _causal_blocked(q: jax.Array, key: jax.Array, value: jax.Array, blocks: int) -> jax.Array:
    """Causal attention, query block ``i`` against keys ``[0, (i+1)·c)`` only, masked on its diagonal block."""
    c = q.shape[3] // blocks
    outs = []
    for i in range(blocks):
        end = (i + 1) * c
        outs.append(_attend(q[:, :, :, i * c : end], key[:, :, :end], value[:, :, :end], _causal(c, end, i * c), None))
    return jnp.concatenate(outs, axis=3)


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
        if dropout_p > 0 or not grouped or (query.shape[1] != key.shape[1] and not enable_gqa):
            return reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env=env)
        return call_jax(attention_jax, query, key, value, attn_mask, is_causal, scale)

    return sdpa


def install(tx: Environment) -> None:
    """Registers the lowering in ``tx``, torchax's own kept as the fallback."""
    for op in ATTENTION_OPS:
        reference = tx._ops[op].func  # private: torchax's own lowering, kept as the fallback
        register(tx, op, attention(reference, interop.call_jax), jax_function=False, needs_env=True)
