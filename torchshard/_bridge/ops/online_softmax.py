"""The online-softmax tile both attention kernels fold over: flash attention's key tiles and the context ring's
key blocks (torchshard._strategies.context.ring_attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Stats = tuple[jax.Array, jax.Array, jax.Array]  # running max [..., q], sum [..., q], weighted values [..., q, h]
F32 = jnp.float32


def masked(s: jax.Array, keep: jax.Array) -> jax.Array:
    """Scores ``s`` with -inf where ``keep`` (any shape that broadcasts to ``s``'s) is False.

    Added as a bias of ``keep``'s own shape, not ``jnp.where``: a where broadcasts the mask and the
    -inf to the scores' full [b, k, g, q, s] shape, and under a scanned ``jax.checkpoint`` JAX saves
    those loop-invariant broadcasts as residuals, one per ring step and tile (a 2-layer Llama at 4k
    tokens on 4 context devices held 300 MiB of them).

    Examples:
        >>> masked(jnp.ones((1, 2, 2)), jnp.array([[True, False], [True, True]])).tolist()
        [[[1.0, -inf], [1.0, 1.0]]]
    """
    return s + jnp.where(keep, 0.0, -jnp.inf).astype(s.dtype)


def fold(stats: Stats, s: jax.Array, v: jax.Array) -> Stats:
    """One tile's scores ``s`` [b, k, g, q, s] and values ``v`` [b, k, s, h] folded into the running ``stats``.

    Examples:
        >>> s, v = jnp.zeros((1, 1, 1, 2, 3)), jnp.ones((1, 1, 3, 4))
        >>> start = (jnp.full((1, 1, 1, 2), -jnp.inf), jnp.zeros((1, 1, 1, 2)), jnp.zeros((1, 1, 1, 2, 4)))
        >>> m, total, acc = fold(start, s, v)
        >>> (acc / total[..., None])[0, 0, 0, 0].tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    m, total, acc = stats
    m_new = jnp.maximum(m, s.max(-1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet stays at zero weight
    p = jnp.exp(s - shift[..., None])
    alpha = jnp.exp(m - shift)
    pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), v, preferred_element_type=F32)
    return m_new, alpha * total + p.sum(-1), alpha[..., None] * acc + pv


def probabilities(s: jax.Array, lse: jax.Array) -> jax.Array:
    """A tile's softmax probabilities, recomputed from its scores ``s`` and the saved log-sum-exp of each row."""
    return jnp.exp(s - lse[..., None])


def unfold(
    p: jax.Array, delta: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv, dscores) of one tile from its `probabilities` ``p`` and ``delta`` (the row sums of
    ``do · out``)."""
    dp = jnp.einsum("bkgqh,bksh->bkgqs", do, v, preferred_element_type=F32)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(k.dtype), k, preferred_element_type=F32)
    dk = jnp.einsum("bkgqs,bkgqh->bksh", ds.astype(q.dtype), q, preferred_element_type=F32)
    dv = jnp.einsum("bkgqs,bkgqh->bksh", p.astype(do.dtype), do, preferred_element_type=F32)
    return dq, dk, dv, ds
