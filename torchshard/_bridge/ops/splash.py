"""Pallas' splash attention (the TPU flash kernel JAX ships) on torch's [batch, heads, seq, dim] layout.

Splash takes one batch entry's heads at a time: queries [heads, s, d] against keys and values
[heads, t, d] (multi-head) or [t, d] (one KV head shared by a group), so batch entries and KV-head
groups are vmapped. It scales nothing itself: the queries are scaled first, as torch's SDPA does.
``interpret=True`` runs the same kernel on any backend (the tests run it on the CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def splash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool,
    scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """softmax(q·kᵀ·scale)·v with splash attention, torch's top-left causal mask when ``causal``.

    Args:
        query: [b, heads, s, d]; ``s`` a multiple of splash's 128-row blocks.
        key: [b, kv_heads, t, d]; ``heads`` a multiple of ``kv_heads`` (head ``n`` reads KV head ``n // group``).
        value: like ``key``.
        causal: mask keys after each query (``s == t``).
        scale: the score scale (default ``d ** -0.5``).
        interpret: run Pallas' interpreter instead of compiling for a TPU.

    Examples:
        >>> q = jnp.ones((1, 2, 128, 8))
        >>> splash_attention(q, q, q, causal=True, interpret=True).shape
        (1, 2, 128, 8)
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    b, heads, s, d = query.shape
    kv_heads, t = key.shape[1], key.shape[2]
    group = heads // kv_heads
    shape = (s, t)
    one = mask_lib.CausalMask(shape) if causal else mask_lib.FullMask(shape)
    scale = d**-0.5 if scale is None else scale
    q = query * jnp.asarray(scale, query.dtype)
    if group == 1:
        mha = kernel_lib.make_splash_mha(
            mask_lib.MultiHeadMask([one] * heads), head_shards=1, q_seq_shards=1, interpret=interpret
        )
        return jax.vmap(mha)(q, key, value)
    mqa = kernel_lib.make_splash_mqa(
        mask_lib.MultiHeadMask([one] * group), head_shards=1, q_seq_shards=1, interpret=interpret
    )
    grouped = q.reshape(b, kv_heads, group, s, d)
    out = jax.vmap(jax.vmap(mqa))(grouped, key, value)  # over batch entries, then KV heads
    return out.reshape(b, heads, s, value.shape[-1])
