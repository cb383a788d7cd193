"""context_attention: attention over a sequence split along a mesh axis, as one ``shard_map`` round the ring.

The per-device work (blocks met one per ring step, the online softmax and its backward) is in
`ring_passes`; here the rows are zig-zagged when balanced, K/V gathered when asked, and the
``shard_map`` built: manual over the context axis (and, with documents, the batch's row axes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from torchshard._bridge.vmapped import vmapped_axes
from torchshard._strategies.context.ring_layout import SequenceLayout, from_zigzag, to_zigzag
from torchshard._strategies.context.ring_passes import KEY_TILE, Ring, Seg, attend, gather


def _local(ring: Ring, device: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, seg: Seg = None) -> jax.Array:
    # the device's index arrives as data (its slice of an iota) rather than from lax.axis_index:
    # XLA may move an axis_index's partition-id out of the manual region, where the SPMD
    # partitioner refuses it (seen with a 4-layer Llama: "PartitionId instruction is not supported")
    me, n = device[0], ring.layout.devices
    if ring.layout.balanced:
        q, k, v = (to_zigzag(x, ring.axis, n, dim, me) for x, dim in ((q, 3), (k, 2), (v, 2)))
        seg = None if seg is None else to_zigzag(seg, ring.axis, n, 1, me)
    k_seg = seg
    if ring.gathered:
        k, v = gather(k, ring), gather(v, ring)
        k_seg = None if seg is None else gather(seg, ring)
    out = attend(ring, q, k, v, k_seg, seg, me)
    return from_zigzag(out, ring.axis, n, 3, me) if ring.layout.balanced else out


def context_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    causal: bool,
    scale: float | None = None,
    gathered: bool = False,
    balanced: bool = False,
    key_tile: int = KEY_TILE,
    segments: jax.Array | None = None,
    rows: tuple[str, ...] = (),
    window: int | None = None,
) -> jax.Array:
    """softmax(q·kᵀ·scale)·v in torch's [batch, heads, seq, dim] layout, the sequence split over ``axis``.

    Args:
        query: [b, heads, s, d] (global shape; traced under jit).
        key: [b, kv_heads, s, d]; ``heads`` a multiple of ``kv_heads`` (head ``n`` reads kv head
            ``n // (heads // kv_heads)``, as torch's ``enable_gqa``).
        value: [b, kv_heads, s, e]; ``e`` may differ from ``d`` (MLA's value head dim).
        mesh: the mesh; only ``axis`` is manual, other axes stay with GSPMD.
        axis: the context axis; ``s`` must divide by its size (twice that when ``balanced``).
        causal: torch's top-left causal mask.
        scale: the score scale (default ``d ** -0.5``).
        gathered: gather K/V over the axis instead of passing blocks round the ring.
        balanced: zig-zag the rows inside the attention so every device does equal causal work.
        key_tile: fold at most this many keys at a time (the scores a device holds: its rows × this).
        segments: [b or 1, s] integer document ids, non-decreasing along each row (from
            `segment_ids`): a query sees only keys of its own document (and, when ``causal``, not after it).
        rows: the mesh axes ``b`` is split over; with ``segments`` they are manual too, so each device
            skips the tiles its own rows do not see.
        window: with ``causal``, a sliding window (transformers' ``sliding_window``): query ``i`` sees
            keys ``i - window < j <= i``; tiles wholly outside it are skipped.

    Examples:
        >>> auto = (jax.sharding.AxisType.Auto,)
        >>> mesh = jax.make_mesh((4,), ("context",), axis_types=auto, devices=jax.devices()[:4])
        >>> q = jnp.ones((1, 2, 16, 8))
        >>> ring = functools.partial(context_attention, mesh=mesh, axis="context", causal=True, balanced=True)
        >>> attend = jax.jit(ring)  # one compiled program; called eagerly, every op dispatches alone
        >>> attend(q, q, q).shape
        (1, 2, 16, 8)
    """
    b, heads, s, d = query.shape
    kv_heads = key.shape[1]
    scale = d**-0.5 if scale is None else scale
    q = (query * jnp.asarray(scale, query.dtype)).reshape(b, kv_heads, heads // kv_heads, s, d)
    rows = _manual_rows(mesh, rows, b) if segments is not None else ()
    layout = SequenceLayout(s, mesh.shape[axis], balanced and causal)
    ring = Ring(axis, layout, causal, gathered, key_tile, vmapped_axes(), rows, window if causal else None)
    batch = rows or None
    q_spec, kv_spec = PartitionSpec(batch, None, None, axis, None), PartitionSpec(batch, None, axis, None)
    args, in_specs = [q, key, value], [q_spec, kv_spec, kv_spec]
    if segments is not None:
        args.append(jnp.broadcast_to(segments.astype(jnp.int32), (b, s)))
        in_specs.append(PartitionSpec(batch, axis))
    # inside a pipeline's stages the stage axis is manual too; JAX's batching rule then types the
    # values as varying over it where this code says only the context axis, so its check is off there
    manual = frozenset({axis, *rows}) | ring.vmapped
    local = functools.partial(_local, ring)
    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(axis), *in_specs),
        out_specs=q_spec,
        axis_names=manual,
        check_vma=not ring.vmapped,
    )
    devices = jnp.arange(mesh.shape[axis], dtype=jnp.int32)
    return sharded(devices, *args).reshape(b, heads, s, value.shape[-1])


def _manual_rows(mesh: Mesh, rows: tuple[str, ...], b: int) -> tuple[str, ...]:
    """``rows`` if ``b`` rows split evenly over them (and none is a pipeline's stage axis), else none."""
    size = 1
    for axis in rows:
        size *= mesh.shape[axis]
    return rows if rows and b % size == 0 and not set(rows) & vmapped_axes() else ()
