"""A library's fused attention (``jax.nn.dot_product_attention``'s signature) on torch's SDPA layout and semantics."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

Attend = Callable[..., jax.Array]  # (q, k, v, bias, mask, *, scale, is_causal) -> out, all [b, s, heads, d]


def torch_layout(attend: Attend, query, key, value, attn_mask, is_causal, scale) -> jax.Array:
    """``attend`` on torch's [b, heads, s, d] layout, with torch's SDPA semantics.

    ``attend`` takes ``jax.nn.dot_product_attention``'s arguments; its grouping of query heads over
    KV heads must be torch's ``enable_gqa``'s (head ``n`` reads KV head ``n // group``), and its causal
    mask torch's top-left one. A mask or bias is broadcast to the full [s, t] (cuDNN takes no broadcast
    sequence dims).

    Examples:
        >>> q = jnp.ones((1, 2, 4, 8))
        >>> torch_layout(jax.nn.dot_product_attention, q, q, q, None, True, None).shape
        (1, 2, 4, 8)
    """
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))  # [b, s, heads, d]
    mask = bias = None
    seen = jnp.bool_(True)
    if attn_mask is not None:
        m = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + attn_mask.shape)
        m = jnp.broadcast_to(m, (*m.shape[:2], query.shape[2], key.shape[2]))
        # a row that sees no key: torch's SDPA gives it zeros (and zero gradients); JAX's softmax over no
        # key averages every value, or is nan. So such rows see every key, and their output is zeroed.
        seen = (m if m.dtype == jnp.bool_ else m > -jnp.inf).any(-1, keepdims=True)
        m = m | ~seen if m.dtype == jnp.bool_ else jnp.where(seen, m, 0)
        mask, bias = (m, None) if m.dtype == jnp.bool_ else (None, m.astype(query.dtype))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = attend(q, k, v, bias, mask, scale=scale, is_causal=is_causal)
    return jnp.where(seen, jnp.swapaxes(out, 1, 2), 0)


def fused_jax(kernel: Literal["xla", "cudnn"], query, key, value, attn_mask, is_causal, scale) -> Any:
    """``jax.nn.dot_product_attention(implementation=kernel)`` ("xla" or "cudnn") on torch's [b, heads, s, d] layout.

    Examples:
        >>> q = jnp.ones((1, 2, 4, 8))
        >>> fused_jax("xla", q, q[:, :1], q[:, :1], None, True, None).shape
        (1, 2, 4, 8)
    """
    attend = functools.partial(jax.nn.dot_product_attention, implementation=kernel)
    return torch_layout(attend, query, key, value, attn_mask, is_causal, scale)
