"""Checksums of sharded arrays that are the same for every sharding, mesh and reduction order."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words (64-bit values give two words each, complex ones those of both parts)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return _words(jax.random.key_data(x))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):  # bitcast takes no complex operand: the parts, side by side
        return _words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = jax.dtypes.itemsize_bits(x.dtype)  # 4 for int4 / float4, which take one byte each in numpy
    if bits >= 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """Row-major flat index of every element (mod 2**32), built without reshaping sharded data."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index += jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


def _fingerprint(x: jax.Array) -> jax.Array:
    # Integer sums wrap exactly, so the result is the same for every sharding and reduction order;
    # the plain sum notices any single flipped bit, the position-weighted one moved values.
    words = _words(x)
    weights = _positions(words.shape) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([words.sum(dtype=jnp.uint32), (words * weights).sum(dtype=jnp.uint32)])


_fingerprints = jax.jit(lambda tree: jax.tree.map(_fingerprint, tree))


def fingerprints(tree: Any) -> Any:
    """`checksums` still on the devices: dispatched at once, read later (a save overlaps them with its writes)."""
    return _fingerprints(tree)


def read_checksums(fingerprints_: Any) -> Any:
    """The host values of `fingerprints`: a tree of ``[int, int]`` (waits for them)."""
    return jax.tree.map(lambda s: [int(v) for v in s], jax.device_get(fingerprints_))


def checksums(tree: Any) -> Any:
    """The same tree with each array replaced by its two uint32 checksums (a list of two ints).

    Example:
        >>> checksums({"w": jnp.arange(4.0)})
        {'w': [3217031168, 3225419776]}
    """
    return read_checksums(fingerprints(tree))


def is_checksum(x: Any) -> bool:
    """Whether ``x`` is one leaf of `checksums`' result."""
    return isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) for v in x)
