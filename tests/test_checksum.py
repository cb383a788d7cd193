"""Checkpoint checksums: the host's sums of each process's shards equal the device's, for every dtype and sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torchshard._ckpt import checksum

SLOW = pytest.mark.slow  # each dtype compiles the device checksum per layout
OTHERS = (jnp.float16, jnp.float8_e4m3fn, jnp.int8, jnp.uint8, jnp.int32, jnp.uint32, jnp.bool_)
DTYPES = [jnp.float32, jnp.bfloat16, *(pytest.param(d, marks=SLOW) for d in OTHERS)]
LAYOUTS = [((), P()), ((8,), P("data")), ((8, 6), P("data", "model")), ((8, 6), P(None, "model")),
           ((4, 6, 10), P("data", None, "model")), ((12, 16), P()), ((3, 5), P())]  # fmt: skip


def on_device(x: jax.Array) -> list[int]:
    """The definition: the jitted checksum (a reduction over the devices)."""
    return [int(v) for v in jax.device_get(checksum._fingerprint_one(x))]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_host_checksums_equal_the_device_definition_for_every_sharding(mesh_dm, dtype):
    rng = np.random.default_rng(0)
    for shape, spec in LAYOUTS:
        x = jax.device_put(jnp.asarray(rng.standard_normal(shape) * 100).astype(dtype), NamedSharding(mesh_dm, spec))
        assert checksum.on_host(x.dtype)
        assert checksum.checksums({"x": x})["x"] == on_device(x), (shape, spec)


def test_a_moved_or_flipped_value_changes_the_checksum(mesh_dm):
    x = jnp.arange(48.0).reshape(8, 6)
    sums = checksum.checksums({"x": x})["x"]
    swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
    flipped = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32).at[3, 2].add(1), jnp.float32)
    assert checksum.checksums({"x": swapped})["x"][0] == sums[0] != checksum.checksums({"x": swapped})["x"][1]
    assert checksum.checksums({"x": flipped})["x"][0] != sums[0]


def test_dtypes_the_host_cannot_sum_use_the_device(mesh_dm):
    tree = {"i4": jnp.arange(3, dtype=jnp.int4), "c": jnp.ones(3, jnp.complex64), "key": jax.random.key(0)}
    assert not any(checksum.on_host(x.dtype) for x in tree.values())
    assert checksum.checksums(tree) == {k: on_device(x) for k, x in tree.items()}


def test_starting_the_checksums_works_out_every_shards_index_and_replica_on_the_calling_thread(mesh_dm):
    # jax computes them on first use and not thread-safely: a background save's writer thread crashed doing so
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh_dm, P("data", None)))
    checksum.start_checksums({"x": x})
    assert all({"index", "replica_id"} <= vars(shard).keys() for shard in x.addressable_shards)
