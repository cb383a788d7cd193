"""Choosing the next token from logits: greedy, or sampled after temperature, top-k and top-p, as transformers does."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen and when rows stop: ``temperature`` 0 is greedy; rows stop after an ``eos`` token."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos: tuple[int, ...] = ()
    pad: int = 0


def _top_k(logits: jax.Array, k: int) -> jax.Array:
    kth = jax.lax.top_k(logits, min(k, logits.shape[-1]))[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def _top_p(logits: jax.Array, p: float) -> jax.Array:
    """Keeps the most likely tokens whose probabilities sum to ``p`` (at least one), as transformers' warper."""
    order = jnp.argsort(logits, axis=-1)  # ascending, as TopPLogitsWarper sorts
    ascending = jnp.take_along_axis(logits, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    drop = (cumulative <= 1 - p).at[..., -1].set(False)
    dropped = jnp.zeros_like(drop).at[jnp.arange(drop.shape[0])[:, None], order].set(drop)
    return jnp.where(dropped, -jnp.inf, logits)


def choose(logits: jax.Array, key: jax.Array, index: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row of ``logits`` [B, V] (int32); sampled ones draw from ``key`` folded with ``index``."""
    logits = logits.astype(jnp.float32)
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        logits = _top_k(logits, sampling.top_k)
    if sampling.top_p is not None and sampling.top_p < 1:
        logits = _top_p(logits, sampling.top_p)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(key), index)
    return jax.random.categorical(step_key, logits, axis=-1).astype(jnp.int32)


def finish(token: jax.Array, done: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array]:
    """Rows already done get ``pad``; a row is done once it has produced an ``eos`` token."""
    token = jnp.where(done, sampling.pad, token)
    if sampling.eos:
        done = done | jnp.isin(token, jnp.asarray(sampling.eos, token.dtype))
    return token, done
