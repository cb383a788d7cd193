"""Checksums of sharded arrays that are the same for every sharding, mesh and reduction order.

Two uint32 sums of an array's bits: plain, and weighted by each element's row-major position.
The host computes them from each process's shards (numpy, a pass per dimension, 10-30 times
faster than the jitted version on CPU devices, and nothing that contends with a training step);
the device version remains for dtypes numpy cannot view as whole words (sub-byte, 64-bit,
complex, PRNG keys) and defines the values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torchshard._multihost.agree import gathered


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


_fingerprint_one = jax.jit(_fingerprint)


def _host_words(a: np.ndarray) -> np.ndarray:
    """`_words` on the host, for the dtypes `on_host` accepts."""
    if a.dtype == np.bool_:
        return a.astype(np.uint32)
    unsigned = np.dtype(f"uint{8 * a.dtype.itemsize}")
    return a.view(unsigned) if a.dtype.itemsize == 4 else a.view(unsigned).astype(np.uint32)


def on_host(dtype: Any) -> bool:
    """Whether the host computes the checksum of a ``dtype`` array: whole-byte real dtypes of at most 32 bits.

    Examples:
        >>> on_host(jnp.bfloat16), on_host(jnp.complex64)
        (True, False)
    """
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return False
    size = np.dtype(dtype).itemsize
    return size in (1, 2, 4) and jax.dtypes.itemsize_bits(dtype) == 8 * size


def shard_sums(data: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int]:
    """One shard's part of ``[sum(words), sum(words * (2 * position + 1))]`` (mod 2**32).

    The weighted sum splits by dimension: each position is the sum over dims of its global index
    times the dim's stride, so each dim needs only its marginal sums (a reduction over the others).
    """
    words = _host_words(np.asarray(data))
    total = None
    weighted, stride = 0, 1
    for dim in reversed(range(words.ndim)):
        others = tuple(d for d in range(words.ndim) if d != dim)
        marginal = words.sum(axis=others, dtype=np.uint32)
        total = int(marginal.sum(dtype=np.uint32)) if total is None else total  # one pass fewer over the data
        first = index[dim].start or 0 if dim < len(index) else 0
        positions = (np.arange(first, first + words.shape[dim], dtype=np.uint64) % 2**32).astype(np.uint32)
        weighted += int((marginal * positions).sum(dtype=np.uint32)) * stride
        stride *= shape[dim]
    total = int(words.sum(dtype=np.uint32)) if total is None else total  # a 0-d array has no dimension to sum
    return total % 2**32, (total + 2 * weighted) % 2**32


def _host_sums(x: jax.Array) -> tuple[int, int]:
    """This process's part of ``x``'s checksum: its shards that are replica 0 (each element once over all processes)."""
    shards = [s for s in x.addressable_shards if s.replica_id == 0]
    parts = [shard_sums(np.asarray(s.data), tuple(s.index), tuple(x.shape)) for s in shards]
    return sum(p[0] for p in parts) % 2**32, sum(p[1] for p in parts) % 2**32


def _list_shards(x: Any) -> None:
    """Has jax work out ``x``'s shards, and each one's index and replica, here, where the snapshot is taken.

    It does so on first use and not thread-safely: on two threads at once (the write and the sums) it could list
    a device twice, and a background save's writer thread crashed the process (a segmentation fault in its first
    ``shard.index``). An array it cannot list raises again where it is read.
    """
    with contextlib.suppress(ValueError):
        for shard in getattr(x, "addressable_shards", ()):
            _ = shard.index, shard.replica_id


@dataclasses.dataclass(frozen=True)
class Started:
    """Checksums under way: the device's for the few arrays the host cannot sum, already dispatched."""

    tree: Any
    on_device: dict[int, jax.Array]


def start_checksums(tree: Any) -> Started:
    """Dispatches the device checksums of arrays the host cannot sum (a collective: call it where steps run)."""
    leaves = jax.tree.leaves(tree)
    for x in leaves:
        _list_shards(x)
    device = {i: _fingerprint_one(x) for i, x in enumerate(leaves) if not on_host(getattr(x, "dtype", None))}
    return Started(tree, device)


def finish_checksums(started: Started, local: list[tuple[int, int] | None] | None = None) -> Any:
    """The tree of ``[int, int]`` checksums: host sums of this process's shards, added up over processes.

    ``local`` (per leaf) are this process's host sums where the caller has them already (a load
    sums what it reads); ``None`` in it, or no ``local``, sums the leaf's shards here. Safe on any
    thread: processes add their sums up through the coordination service.
    """
    leaves, treedef = jax.tree.flatten(started.tree)
    have = local or [None] * len(leaves)
    local_ = [
        list(_host_sums(x) if mine is None else mine) if i not in started.on_device else [0, 0]
        for i, (x, mine) in enumerate(zip(leaves, have, strict=True))
    ]
    by_leaf = zip(*_everyones(local_), strict=True)  # per leaf: every process's [plain, weighted]
    sums = [[sum(column) % 2**32 for column in zip(*parts, strict=True)] for parts in by_leaf]
    for i, fingerprint in started.on_device.items():
        sums[i] = [int(v) for v in jax.device_get(fingerprint)]
    return jax.tree.unflatten(treedef, sums)


def _everyones(local: list[list[int]]) -> list[list[list[int]]]:
    if jax.process_count() == 1:
        return [local]
    return [json.loads(v) for v in gathered("checksums", json.dumps(local))]


def checksums(tree: Any) -> Any:
    """The same tree with each array replaced by its two uint32 checksums (a list of two ints).

    Examples:
        >>> checksums({"w": jnp.arange(4.0)})
        {'w': [3217031168, 3225419776]}
    """
    return finish_checksums(start_checksums(tree))


def is_checksum(x: Any) -> bool:
    """Whether ``x`` is one leaf of `checksums`' result."""
    return isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) for v in x)
