"""Attention over a sequence sharded along a mesh axis: K/V blocks passed round the axis or gathered, online softmax.

Runs inside a ``shard_map`` that is manual over the context axis only. Each device keeps its own
query rows and meets every key block once, one block per ring step: the block of device
``(i - t) mod n`` at step ``t``. Scores are folded into a running max, sum and weighted value
(the log-sum-exp carry) a tile of keys at a time, so a device holds O(S/n) activations and one
``(S/n) × KEY_TILE`` block of scores.
The backward pass runs the ring again from the saved log-sum-exp (a custom VJP): the key/value
gradients travel with their block and arrive back at its owner after the last step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from torchshard._parallel.vmapped import vmapped_axes

Stats = tuple[jax.Array, jax.Array, jax.Array]  # running max, running sum, running weighted values (all f32)
# keys folded at a time: a device holds a (S/n) × KEY_TILE block of scores per head, not (S/n) × (S/n)
KEY_TILE = 512


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which sequence positions a device's local rows hold: ``parts`` runs of ``run`` consecutive positions.

    Natural: device ``i`` holds ``[i·run, (i+1)·run)``. Balanced (zig-zag): the sequence is cut into
    ``2n`` chunks and device ``i`` holds chunks ``i`` and ``2n-1-i``, so under a causal mask every
    device has the same number of visible (query, key) pairs.

    Example:
        >>> [int(s) for s in Layout(seq=16, devices=4, balanced=True).starts(1)]
        [2, 12]
    """

    seq: int
    devices: int
    balanced: bool

    @property
    def parts(self) -> int:
        return 2 if self.balanced else 1

    @property
    def run(self) -> int:
        return self.seq // (self.devices * self.parts)

    def starts(self, device: jax.Array | int) -> tuple[jax.Array, ...]:
        """First position of each run of ``device`` (a traced index inside the shard_map)."""
        if self.balanced:
            return jnp.asarray(device * self.run), jnp.asarray((2 * self.devices - 1 - device) * self.run)
        return (jnp.asarray(device * self.run),)


@dataclasses.dataclass(frozen=True)
class Ring:
    """The static description of one context-parallel attention call."""

    axis: str
    layout: Layout
    causal: bool
    gathered: bool  # K/V arrive all-gathered (attention="all_gather") instead of passed by ppermute
    key_tile: int = KEY_TILE
    vmapped: frozenset[str] = frozenset()  # a pipeline's stage axis, manual here too (see `vmapped_axes`)


def _varying(x: jax.Array, ring: Ring) -> jax.Array:
    """A fresh array typed as differing per device: loop carries must match the per-device values they meet."""
    return jax.lax.pcast(x, (ring.axis,), to="varying")


def _runs(x: jax.Array, parts: int, dim: int) -> list[jax.Array]:
    return jnp.split(x, parts, axis=dim) if parts > 1 else [x]


def _join(xs: Sequence[jax.Array], dim: int) -> jax.Array:
    return jnp.concatenate(xs, axis=dim) if len(xs) > 1 else xs[0]


def _pass_on(x: jax.Array, ring: Ring) -> jax.Array:
    n = ring.layout.devices
    return jax.lax.ppermute(x, ring.axis, [(i, (i + 1) % n) for i in range(n)])


def _logits(q: jax.Array, k: jax.Array, q_start: jax.Array, k_start: jax.Array, causal: bool) -> jax.Array:
    """f32 scores of [b, kv, g, q, d] queries (already scaled) against [b, kv, k, d] keys; -inf where masked."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", q, k, preferred_element_type=jnp.float32)
    if causal:
        rows = jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0) + q_start
        cols = jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1) + k_start
        s = jnp.where(rows >= cols, s, -jnp.inf)
    return s


def _sees(q_start: jax.Array, rows: int, k_start: jax.Array, causal: bool) -> jax.Array:
    """Whether any of ``rows`` queries from ``q_start`` sees a key from ``k_start`` (fully masked tiles are skipped)."""
    return k_start <= q_start + rows - 1 if causal else jnp.bool_(True)


def _key_tiles(length: int, most: int) -> int:
    """How many equal tiles of at most ``most`` keys a run of ``length`` keys is folded in (1: tiles under 64)."""
    for tiles in range(-(-length // most), length // min(64, most) + 1):
        if length % tiles == 0:
            return tiles
    return 1


def _tiled(x: jax.Array, tiles: int) -> jax.Array:
    """[b, kv, k, d] → [tiles, b, kv, k / tiles, d]."""
    b, kv, k, d = x.shape
    return jnp.moveaxis(x.reshape(b, kv, tiles, k // tiles, d), 2, 0)


def _untiled(x: jax.Array) -> jax.Array:
    tiles, b, kv, k, d = x.shape
    return jnp.moveaxis(x, 0, 2).reshape(b, kv, tiles * k, d)


def _update(stats: Stats, q: jax.Array, k: jax.Array, v: jax.Array, q_start: jax.Array, k_start: jax.Array,
            causal: bool) -> Stats:  # fmt: skip
    """One key block folded into the running (max, sum, weighted values) of a query run."""
    m, total, acc = stats
    s = _logits(q, k, q_start, k_start, causal)
    m_new = jnp.maximum(m, s.max(-1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet stays at zero weight
    p = jnp.exp(s - shift[..., None])
    alpha = jnp.exp(m - shift)[..., None]
    pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha[..., 0] * total + p.sum(-1), alpha * acc + pv


def _fold(stats: Stats, q: jax.Array, k: jax.Array, v: jax.Array, q_start: jax.Array, k_start: jax.Array,
          ring: Ring) -> Stats:  # fmt: skip
    """Every key tile of a run that a query run sees, folded into that query run's stats."""
    causal, tiles = ring.causal, _key_tiles(k.shape[2], ring.key_tile)
    size = k.shape[2] // tiles

    def tile(stats: Stats, xs: tuple[jax.Array | int, jax.Array, jax.Array]) -> tuple[Stats, None]:
        i, k_tile, v_tile = xs
        start = k_start + i * size
        update = functools.partial(_update, q=q, k=k_tile, v=v_tile, q_start=q_start, k_start=start, causal=causal)
        return jax.lax.cond(_sees(q_start, q.shape[3], start, causal), update, lambda s: s, stats), None

    if tiles == 1:
        return tile(stats, (0, k, v))[0]
    return jax.lax.scan(tile, stats, (jnp.arange(tiles), _tiled(k, tiles), _tiled(v, tiles)))[0]


def _no_keys_yet(q: jax.Array, ring: Ring) -> Stats:
    """The running (max, sum, weighted values) of query rows that have met no key: (-inf, 0, 0)."""
    rows, f32 = q.shape[:-1], jnp.float32
    fresh = (jnp.full(rows, -jnp.inf, f32), jnp.zeros(rows, f32), jnp.zeros(q.shape, f32))
    return _varying(fresh[0], ring), _varying(fresh[1], ring), _varying(fresh[2], ring)


def _source(ring: Ring, me: jax.Array, t: jax.Array | int) -> jax.Array:
    return (me - t) % ring.layout.devices


def _pairs(ring: Ring, me: jax.Array, k: jax.Array, v: jax.Array, t: jax.Array | int):
    """Ring step ``t``'s query run starts, its key block's run starts, and that block's key and value runs."""
    if ring.gathered:
        k, v = k[t], v[t]
    parts = ring.layout.parts
    return ring.layout.starts(me), ring.layout.starts(_source(ring, me, t)), _runs(k, parts, 2), _runs(v, parts, 2)


def _forward_step(ring: Ring, me: jax.Array, qs: list[jax.Array], stats: list[Stats], k: jax.Array, v: jax.Array,
                  t: jax.Array | int) -> list[Stats]:  # fmt: skip
    q_starts, k_starts, ks, vs = _pairs(ring, me, k, v, t)
    stats = list(stats)
    for a, q_start in enumerate(q_starts):
        for c, k_start in enumerate(k_starts):
            stats[a] = _fold(stats[a], qs[a], ks[c], vs[c], q_start, k_start, ring)
    return stats


def _forward(ring: Ring, me: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(output, log-sum-exp) of the local queries against every key block of the axis."""
    qs = _runs(q, ring.layout.parts, 3)
    stats = [_no_keys_yet(run, ring) for run in qs]

    def step(carry, t):
        stats, k, v = carry
        stats = _forward_step(ring, me, qs, stats, k, v, t)
        if not ring.gathered:
            k, v = _pass_on(k, ring), _pass_on(v, ring)
        return (stats, k, v), None

    # the last step is peeled off: its keys/values need not travel on
    last = ring.layout.devices - 1
    (stats, k, v), _ = jax.lax.scan(step, (stats, k, v), jnp.arange(last))
    stats = _forward_step(ring, me, qs, stats, k, v, last)
    out = _join([acc / total[..., None] for _, total, acc in stats], 3)
    lse = _join([m + jnp.log(total) for m, total, _ in stats], 3)
    return out.astype(q.dtype), lse


def _grads(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array,
           q_start: jax.Array, k_start: jax.Array, causal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """(dq, dk, dv) of one (query run, key run) pair, recomputing its probabilities from the saved lse."""
    p = jnp.exp(_logits(q, k, q_start, k_start, causal) - lse[..., None])
    dv = jnp.einsum("bkgqs,bkgqh->bksh", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgqh,bksh->bkgqs", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqs,bkgqh->bksh", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _backward_step(ring: Ring, me: jax.Array, saved: tuple[list[jax.Array], ...], dqs: list[jax.Array], k: jax.Array,
                   v: jax.Array, t: jax.Array | int) -> tuple[list[jax.Array], jax.Array, jax.Array]:  # fmt: skip
    """Adds one key block's share to the query grads; returns them and that block's dk, dv (f32)."""
    qs, dos, lses, deltas = saved
    q_starts, k_starts, ks, vs = _pairs(ring, me, k, v, t)
    parts = ring.layout.parts
    dqs = list(dqs)
    dks: list[list[jax.Array]] = [[] for _ in range(parts)]
    dvs: list[list[jax.Array]] = [[] for _ in range(parts)]
    for a, q_start in enumerate(q_starts):
        for c, k_start in enumerate(k_starts):
            dqs[a], dk, dv = _unfold(dqs[a], (qs[a], dos[a], lses[a], deltas[a]), ks[c], vs[c], q_start, k_start, ring)
            dks[c].append(dk)
            dvs[c].append(dv)
    return dqs, _join([sum(d[1:], d[0]) for d in dks], 2), _join([sum(d[1:], d[0]) for d in dvs], 2)


def _unfold(dq: jax.Array, saved: tuple[jax.Array, ...], k: jax.Array, v: jax.Array, q_start: jax.Array,
            k_start: jax.Array, ring: Ring) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """The backward of `_fold`: dq accumulated over the key tiles the query run sees, and each tile's dk, dv."""
    q, do, lse, delta = saved
    tiles = _key_tiles(k.shape[2], ring.key_tile)
    size = k.shape[2] // tiles
    nothing = _varying(jnp.zeros((*k.shape[:2], size, k.shape[3]), jnp.float32), ring)

    def tile(dq: jax.Array, xs: tuple[jax.Array | int, jax.Array, jax.Array]):
        i, k_tile, v_tile = xs
        start = k_start + i * size

        def grads(dq: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            g = _grads(q, k_tile, v_tile, do, lse, delta, q_start, start, ring.causal)
            return dq + g[0], g[1], g[2]

        dq, dk, dv = jax.lax.cond(_sees(q_start, q.shape[3], start, ring.causal), grads,
                                  lambda dq: (dq, nothing, nothing), dq)  # fmt: skip
        return dq, (dk, dv)

    if tiles == 1:
        dq, (dk, dv) = tile(dq, (0, k, v))
        return dq, dk, dv
    dq, (dks, dvs) = jax.lax.scan(tile, dq, (jnp.arange(tiles), _tiled(k, tiles), _tiled(v, tiles)))
    return dq, _untiled(dks), _untiled(dvs)


def _backward(ring: Ring, res: tuple[jax.Array, ...], do: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, None]:
    q, k, v, out, lse, me = res
    parts = ring.layout.parts
    delta = jnp.einsum("bkgqh,bkgqh->bkgq", do, out, preferred_element_type=jnp.float32)
    saved = (_runs(q, parts, 3), _runs(do, parts, 3), _runs(lse, parts, 3), _runs(delta, parts, 3))
    dqs = [_varying(jnp.zeros(x.shape, jnp.float32), ring) for x in saved[0]]
    dk, dv = (_varying(jnp.zeros(x.shape, jnp.float32), ring) for x in (k, v))

    def step(carry, t, *, last=False):
        dqs, k, v, dk, dv = carry
        dqs, dk_block, dv_block = _backward_step(ring, me, saved, dqs, k, v, t)
        if ring.gathered:
            return (dqs, k, v, dk.at[t].add(dk_block), dv.at[t].add(dv_block)), None
        # the gradients travel with their block: after the last step they reach its owner
        dk, dv = _pass_on(dk + dk_block, ring), _pass_on(dv + dv_block, ring)
        if not last:
            k, v = _pass_on(k, ring), _pass_on(v, ring)
        return (dqs, k, v, dk, dv), None

    last = ring.layout.devices - 1
    carry, _ = jax.lax.scan(step, (dqs, k, v, dk, dv), jnp.arange(last))
    (dqs, _, _, dk, dv), _ = step(carry, last, last=True)
    return _join(dqs, 3).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(ring: Ring, q: jax.Array, k: jax.Array, v: jax.Array, me: jax.Array) -> jax.Array:
    return _forward(ring, me, q, k, v)[0]


def _attend_fwd(
    ring: Ring, q: jax.Array, k: jax.Array, v: jax.Array, me: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, lse = _forward(ring, me, q, k, v)
    return out, (q, k, v, out, lse, me)


_attend.defvjp(_attend_fwd, _backward)


def _zigzag_target(chunk: int, devices: int) -> int:
    return chunk if chunk < devices else 2 * devices - 1 - chunk


def to_zigzag(x: jax.Array, axis: str, devices: int, dim: int, me: jax.Array) -> jax.Array:
    """Local rows in natural order (device ``i``: chunks ``2i, 2i+1``) → zig-zag (chunks ``i, 2n-1-i``).

    Chunk ``2i`` goes to device ``z(2i)`` and chunk ``2i+1`` to ``z(2i+1)``, ``z(c) = min(c, 2n-1-c)``;
    each device receives one even and one odd chunk, so two ppermutes move everything once.
    """
    even, odd = jnp.split(x, 2, axis=dim)
    even = jax.lax.ppermute(even, axis, [(i, _zigzag_target(2 * i, devices)) for i in range(devices)])
    odd = jax.lax.ppermute(odd, axis, [(i, _zigzag_target(2 * i + 1, devices)) for i in range(devices)])
    # device j holds chunk j first: the even one when j is even
    j_even = me % 2 == 0
    return jnp.concatenate([jnp.where(j_even, even, odd), jnp.where(j_even, odd, even)], axis=dim)


def from_zigzag(x: jax.Array, axis: str, devices: int, dim: int, me: jax.Array) -> jax.Array:
    """The inverse of `to_zigzag`."""
    first, second = jnp.split(x, 2, axis=dim)
    j_even = me % 2 == 0
    even, odd = jnp.where(j_even, first, second), jnp.where(j_even, second, first)
    even = jax.lax.ppermute(even, axis, [(_zigzag_target(2 * i, devices), i) for i in range(devices)])
    odd = jax.lax.ppermute(odd, axis, [(_zigzag_target(2 * i + 1, devices), i) for i in range(devices)])
    return jnp.concatenate([even, odd], axis=dim)


def _gather(x: jax.Array, ring: Ring) -> jax.Array:
    """Every device's block, [n, ...], entry ``t`` the block of device ``(i - t) mod n`` (what ring step t meets).

    A chain of ppermutes, not ``lax.all_gather``: inside a shard_map manual over this axis only,
    XLA's all-gather (and its reduce-scatter transpose) also gathers the batch over the other
    axes; ppermutes keep it split. Autodiff turns the chain into the matching reduce-scatter.
    """
    blocks = [x]
    for _ in range(ring.layout.devices - 1):
        blocks.append(_pass_on(blocks[-1], ring))
    return jnp.stack(blocks)


def _local(ring: Ring, device: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    # the device's index arrives as data (its slice of an iota) rather than from lax.axis_index:
    # XLA may move an axis_index's partition-id out of the manual region, where the SPMD
    # partitioner refuses it (seen with a 4-layer Llama: "PartitionId instruction is not supported")
    me, n = device[0], ring.layout.devices
    if ring.layout.balanced:
        q, k, v = (to_zigzag(x, ring.axis, n, dim, me) for x, dim in ((q, 3), (k, 2), (v, 2)))
    if ring.gathered:
        k, v = _gather(k, ring), _gather(v, ring)
    out = _attend(ring, q, k, v, me)
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
) -> jax.Array:
    """softmax(q·kᵀ·scale)·v in torch's [batch, heads, seq, dim] layout, the sequence split over ``axis``.

    Args:
        query: [b, heads, s, d] (global shape; traced under jit).
        key: [b, kv_heads, s, d]; ``heads`` a multiple of ``kv_heads`` (head ``n`` reads kv head
            ``n // (heads // kv_heads)``, as torch's ``enable_gqa``).
        value: like ``key``.
        mesh: the mesh; only ``axis`` is manual, other axes stay with GSPMD.
        axis: the context axis; ``s`` must divide by its size (twice that when ``balanced``).
        causal: torch's top-left causal mask.
        scale: the score scale (default ``d ** -0.5``).
        gathered: gather K/V over the axis instead of passing blocks round the ring.
        balanced: zig-zag the rows inside the attention so every device does equal causal work.
        key_tile: fold at most this many keys at a time (the scores a device holds: its rows × this).

    Example:
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
    ring = Ring(axis, Layout(s, mesh.shape[axis], balanced and causal), causal, gathered, key_tile, vmapped_axes())
    q_spec, kv_spec = PartitionSpec(None, None, None, axis, None), PartitionSpec(None, None, axis, None)
    local = functools.partial(_local, ring)
    in_specs = (PartitionSpec(axis), q_spec, kv_spec, kv_spec)
    # inside a pipeline's stages the stage axis is manual too; JAX's batching rule then types the
    # values as varying over it where this code says only the context axis, so its check is off there
    manual = frozenset({axis}) | ring.vmapped
    sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=q_spec, axis_names=manual,
                            check_vma=not ring.vmapped)  # fmt: skip
    devices = jnp.arange(mesh.shape[axis], dtype=jnp.int32)
    return sharded(devices, q, key, value).reshape(b, heads, s, d)
