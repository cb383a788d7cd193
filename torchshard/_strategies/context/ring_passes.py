"""The ring's forward and backward passes: per device, key blocks met one per step, folded by an online softmax.

Runs inside the ``shard_map`` of `context_attention` (manual over the context axis and, with
documents, the batch's row axes). Each device keeps its own query rows and meets every key block
once, one block per ring step: the block of device ``(i - t) mod n`` at step ``t``. Scores are
folded into a running max, sum and weighted value (the log-sum-exp carry) a tile of keys at a
time, so a device holds O(S/n) activations and one ``(S/n) × KEY_TILE`` block of scores.
The backward pass runs the ring again from the saved log-sum-exp (a custom VJP): the key/value
gradients travel with their block and arrive back at its owner after the last step.
With documents (packed rows), each token's segment id travels with its key: a query sees the
keys of its own segment only, and a tile with no visible (query, key) pair is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from torchshard._bridge.ops import online_softmax
from torchshard._bridge.ops.flash import TILE_SCOPE
from torchshard._strategies.context.ring_layout import SequenceLayout

Stats = tuple[jax.Array, jax.Array, jax.Array]  # running max, running sum, running weighted values (all f32)
Seg = jax.Array | None  # [b, s] segment ids of a run of tokens (non-decreasing along it); None: one document
Keys = tuple[jax.Array, jax.Array, Seg]  # a block of keys [b, kv, s, d], their values, their segment ids
# keys folded at a time: a device holds a (S/n) × KEY_TILE block of scores per head, not (S/n) × (S/n)
KEY_TILE = 512


@dataclasses.dataclass(frozen=True)
class Ring:
    """The static description of one context-parallel attention call."""

    axis: str
    layout: SequenceLayout
    causal: bool
    gathered: bool  # K/V arrive all-gathered (attention="all_gather") instead of passed by ppermute
    key_tile: int = KEY_TILE
    vmapped: frozenset[str] = frozenset()  # a pipeline's stage axis, manual here too (see `vmapped_axes`)
    rows: tuple[str, ...] = ()  # the batch's row axes, manual with documents: tiles are skipped per device
    window: int | None = None  # causal sliding window: a query sees itself and the window - 1 keys before it


def _varying(x: jax.Array, ring: Ring) -> jax.Array:
    """A fresh array typed as differing per device: loop carries must match the per-device values they meet."""
    return jax.lax.pcast(x, (*ring.rows, ring.axis), to="varying")


def _runs(x: jax.Array, parts: int, dim: int) -> list[jax.Array]:
    return jnp.split(x, parts, axis=dim) if parts > 1 else [x]


def _seg_runs(seg: Seg, parts: int) -> list[Seg]:
    return [None] * parts if seg is None else list(_runs(seg, parts, 1))


def _join(xs: Sequence[jax.Array], dim: int) -> jax.Array:
    return jnp.concatenate(xs, axis=dim) if len(xs) > 1 else xs[0]


def _pass_on(x: jax.Array, ring: Ring) -> jax.Array:
    n = ring.layout.devices
    return jax.lax.ppermute(x, ring.axis, [(i, (i + 1) % n) for i in range(n)])


def _pass_keys(block: Keys, ring: Ring) -> Keys:
    k, v, seg = block
    return _pass_on(k, ring), _pass_on(v, ring), None if seg is None else _pass_on(seg, ring)


def _logits(
    q: jax.Array,
    k: jax.Array,
    q_start: jax.Array,
    k_start: jax.Array,
    causal: bool,
    q_seg: Seg,
    k_seg: Seg,
    window: int | None = None,
) -> jax.Array:
    """f32 scores of [b, kv, g, q, d] queries (already scaled) against [b, kv, k, d] keys; -inf where masked."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", q, k, preferred_element_type=jnp.float32)
    keep = None
    if causal:
        rows = jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0) + q_start
        cols = jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1) + k_start
        keep = rows >= cols if window is None else (rows >= cols) & (rows - cols < window)
    if q_seg is not None and k_seg is not None:
        same = (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
        keep = same if keep is None else same & keep
    return s if keep is None else online_softmax.masked(s, keep)


def _sees(
    q_start: jax.Array, q_seg: Seg, rows: int, k_start: jax.Array, k_seg: Seg, ring: Ring, keys: int
) -> jax.Array:
    """Whether any of ``rows`` queries from ``q_start`` sees one of the ``keys`` keys from ``k_start`` (else the tile
    is skipped): a window's first query sees back to ``q_start - window + 1``.

    Segment ids never decrease along a run, so a row's query and key segments share an id only if
    their ranges overlap.
    """
    seen = k_start <= q_start + rows - 1 if ring.causal else jnp.bool_(True)
    if ring.causal and ring.window is not None:
        seen = seen & (q_start - (k_start + keys - 1) < ring.window)
    if q_seg is not None and k_seg is not None:
        seen = seen & jnp.any((k_seg[:, -1] >= q_seg[:, 0]) & (k_seg[:, 0] <= q_seg[:, -1]))
    return seen


def _key_tiles(length: int, most: int) -> int:
    """How many equal tiles of at most ``most`` keys a run of ``length`` keys is folded in (1: tiles under 64)."""
    for tiles in range(-(-length // most), length // min(64, most) + 1):
        if length % tiles == 0:
            return tiles
    return 1


def _tiled(x: jax.Array, tiles: int, dim: int = 2) -> jax.Array:
    """[b, kv, k, d] → [tiles, b, kv, k / tiles, d] (``dim`` the keys' dim)."""
    shape = (*x.shape[:dim], tiles, x.shape[dim] // tiles, *x.shape[dim + 1 :])
    return jnp.moveaxis(x.reshape(shape), dim, 0)


def _tiled_seg(seg: Seg, tiles: int) -> Seg:
    """[b, k] segment ids → [tiles, b, k / tiles]."""
    return None if seg is None else _tiled(seg, tiles, 1)


def _untiled(x: jax.Array) -> jax.Array:
    tiles, b, kv, k, d = x.shape
    return jnp.moveaxis(x, 0, 2).reshape(b, kv, tiles * k, d)


@jax.named_scope(TILE_SCOPE)
def _update(
    stats: Stats,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_start: jax.Array,
    k_start: jax.Array,
    causal: bool,
    q_seg: Seg,
    k_seg: Seg,
    window: int | None,
) -> Stats:
    """One key block folded into the running (max, sum, weighted values) of a query run."""
    return online_softmax.fold(stats, _logits(q, k, q_start, k_start, causal, q_seg, k_seg, window), v)


def _fold(
    stats: Stats, q: jax.Array, q_start: jax.Array, q_seg: Seg, block: Keys, k_start: jax.Array, ring: Ring
) -> Stats:
    """Every key tile of a run that a query run sees, folded into that query run's stats."""
    k, v, k_seg = block
    causal, tiles = ring.causal, _key_tiles(k.shape[2], ring.key_tile)
    size = k.shape[2] // tiles

    def tile(stats: Stats, xs: tuple[Any, ...]) -> tuple[Stats, None]:
        i, k_tile, v_tile, seg_tile = xs
        start = k_start + i * size
        update = functools.partial(
            _update,
            q=q,
            k=k_tile,
            v=v_tile,
            q_start=q_start,
            k_start=start,
            causal=causal,
            q_seg=q_seg,
            k_seg=seg_tile,
            window=ring.window,
        )
        seen = _sees(q_start, q_seg, q.shape[3], start, seg_tile, ring, size)
        return jax.lax.cond(seen, update, lambda s: s, stats), None

    if tiles == 1:
        return tile(stats, (0, k, v, k_seg))[0]
    xs = (jnp.arange(tiles), _tiled(k, tiles), _tiled(v, tiles), _tiled_seg(k_seg, tiles))
    return jax.lax.scan(tile, stats, xs)[0]


def _no_keys_yet(q: jax.Array, values: int, ring: Ring) -> Stats:
    """The running (max, sum, weighted values) of query rows that have met no key: (-inf, 0, 0).

    ``values`` is the values' head dim, which may differ from the queries' (MLA: 128 against 192).
    """
    rows, f32 = q.shape[:-1], jnp.float32
    fresh = (jnp.full(rows, -jnp.inf, f32), jnp.zeros(rows, f32), jnp.zeros((*rows, values), f32))
    return _varying(fresh[0], ring), _varying(fresh[1], ring), _varying(fresh[2], ring)


def _source(ring: Ring, me: jax.Array, t: jax.Array | int) -> jax.Array:
    return (me - t) % ring.layout.devices


def _pairs(ring: Ring, me: jax.Array, block: Keys, t: jax.Array | int):
    """Ring step ``t``'s query run starts, its key block's run starts, and that block's (keys, values, segments)."""
    k, v, seg = block
    if ring.gathered:
        k, v, seg = k[t], v[t], None if seg is None else seg[t]
    parts = ring.layout.parts
    runs = list(zip(_runs(k, parts, 2), _runs(v, parts, 2), _seg_runs(seg, parts), strict=True))
    return ring.layout.starts(me), ring.layout.starts(_source(ring, me, t)), runs


def _forward_step(
    ring: Ring,
    me: jax.Array,
    queries: tuple[list[jax.Array], list[Seg]],
    stats: list[Stats],
    block: Keys,
    t: jax.Array | int,
) -> list[Stats]:
    qs, q_segs = queries
    q_starts, k_starts, runs = _pairs(ring, me, block, t)
    stats = list(stats)
    for a, q_start in enumerate(q_starts):
        for c, k_start in enumerate(k_starts):
            stats[a] = _fold(stats[a], qs[a], q_start, q_segs[a], runs[c], k_start, ring)
    return stats


def _forward(ring: Ring, me: jax.Array, q: jax.Array, block: Keys, q_seg: Seg) -> tuple[jax.Array, jax.Array]:
    """(output, log-sum-exp) of the local queries against every key block of the axis."""
    queries = (_runs(q, ring.layout.parts, 3), _seg_runs(q_seg, ring.layout.parts))
    stats = [_no_keys_yet(run, block[1].shape[-1], ring) for run in queries[0]]

    def step(carry, t):
        stats, block = carry
        stats = _forward_step(ring, me, queries, stats, block, t)
        return (stats, block if ring.gathered else _pass_keys(block, ring)), None

    # the last step is peeled off: its keys/values need not travel on
    last = ring.layout.devices - 1
    (stats, block), _ = jax.lax.scan(step, (stats, block), jnp.arange(last))
    stats = _forward_step(ring, me, queries, stats, block, last)
    out = _join([acc / total[..., None] for _, total, acc in stats], 3)
    lse = _join([m + jnp.log(total) for m, total, _ in stats], 3)
    return out.astype(q.dtype), lse


@jax.named_scope(TILE_SCOPE)
def _grads(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    q_start: jax.Array,
    k_start: jax.Array,
    causal: bool,
    q_seg: Seg,
    k_seg: Seg,
    window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) of one (query run, key run) pair, recomputing its probabilities from the saved lse."""
    p = online_softmax.probabilities(_logits(q, k, q_start, k_start, causal, q_seg, k_seg, window), lse)
    return online_softmax.unfold(p, delta, q, k, v, do)[:3]


def _backward_step(
    ring: Ring, me: jax.Array, saved: tuple[list, ...], dqs: list[jax.Array], block: Keys, t: jax.Array | int
) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """Adds one key block's share to the query grads; returns them and that block's dk, dv (f32)."""
    qs, dos, lses, deltas, q_segs = saved
    q_starts, k_starts, runs = _pairs(ring, me, block, t)
    parts = ring.layout.parts
    dqs = list(dqs)
    dks: list[list[jax.Array]] = [[] for _ in range(parts)]
    dvs: list[list[jax.Array]] = [[] for _ in range(parts)]
    for a, q_start in enumerate(q_starts):
        for c, k_start in enumerate(k_starts):
            query = (qs[a], dos[a], lses[a], deltas[a], q_segs[a])
            dqs[a], dk, dv = _unfold(dqs[a], query, q_start, runs[c], k_start, ring)
            dks[c].append(dk)
            dvs[c].append(dv)
    return dqs, _join([sum(d[1:], d[0]) for d in dks], 2), _join([sum(d[1:], d[0]) for d in dvs], 2)


def _unfold(
    dq: jax.Array, saved: tuple, q_start: jax.Array, block: Keys, k_start: jax.Array, ring: Ring
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward of `_fold`: dq accumulated over the key tiles the query run sees, and each tile's dk, dv."""
    q, do, lse, delta, q_seg = saved
    k, v, k_seg = block
    tiles = _key_tiles(k.shape[2], ring.key_tile)
    size = k.shape[2] // tiles
    nothing_k, nothing_v = (_varying(jnp.zeros((*x.shape[:2], size, x.shape[3]), jnp.float32), ring) for x in (k, v))

    def tile(dq: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        i, k_tile, v_tile, seg_tile = xs
        start = k_start + i * size

        def grads(dq: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            g = _grads(q, k_tile, v_tile, do, lse, delta, q_start, start, ring.causal, q_seg, seg_tile, ring.window)
            return dq + g[0], g[1], g[2]

        seen = _sees(q_start, q_seg, q.shape[3], start, seg_tile, ring, size)
        dq, dk, dv = jax.lax.cond(seen, grads, lambda dq: (dq, nothing_k, nothing_v), dq)
        return dq, (dk, dv)

    if tiles == 1:
        dq, (dk, dv) = tile(dq, (0, k, v, k_seg))
        return dq, dk, dv
    xs = (jnp.arange(tiles), _tiled(k, tiles), _tiled(v, tiles), _tiled_seg(k_seg, tiles))
    dq, (dks, dvs) = jax.lax.scan(tile, dq, xs)
    return dq, _untiled(dks), _untiled(dvs)


def _backward(ring: Ring, res: tuple, do: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, None, None, None]:
    q, k, v, k_seg, q_seg, out, lse, me = res
    parts = ring.layout.parts
    delta = jnp.einsum("bkgqh,bkgqh->bkgq", do, out, preferred_element_type=jnp.float32)
    saved: tuple[list[Any], ...] = (*(_runs(x, parts, 3) for x in (q, do, lse, delta)), _seg_runs(q_seg, parts))
    dqs = [_varying(jnp.zeros(x.shape, jnp.float32), ring) for x in saved[0]]
    dk, dv = (_varying(jnp.zeros(x.shape, jnp.float32), ring) for x in (k, v))

    def step(carry, t, *, last=False):
        dqs, block, dk, dv = carry
        dqs, dk_block, dv_block = _backward_step(ring, me, saved, dqs, block, t)
        if ring.gathered:
            return (dqs, block, dk.at[t].add(dk_block), dv.at[t].add(dv_block)), None
        # the gradients travel with their block: after the last step they reach its owner
        dk, dv = _pass_on(dk + dk_block, ring), _pass_on(dv + dv_block, ring)
        return (dqs, block if last else _pass_keys(block, ring), dk, dv), None

    last = ring.layout.devices - 1
    carry, _ = jax.lax.scan(step, (dqs, (k, v, k_seg), dk, dv), jnp.arange(last))
    (dqs, _, dk, dv), _ = step(carry, last, last=True)
    return _join(dqs, 3).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(ring: Ring, q: jax.Array, k: jax.Array, v: jax.Array, k_seg: Seg, q_seg: Seg, me: jax.Array) -> jax.Array:
    """Device ``me``'s attention output for its query rows ``q`` [b, kv, g, s/n, d] against every key block.

    ``k``, ``v``, ``k_seg`` are this device's block, or every device's stacked by `gather` when
    ``ring.gathered``; the backward runs the ring again from the saved log-sum-exp.
    """
    return _forward(ring, me, q, (k, v, k_seg), q_seg)[0]


def _attend_fwd(
    ring: Ring, q: jax.Array, k: jax.Array, v: jax.Array, k_seg: Seg, q_seg: Seg, me: jax.Array
) -> tuple[jax.Array, tuple]:
    out, lse = _forward(ring, me, q, (k, v, k_seg), q_seg)
    return out, (q, k, v, k_seg, q_seg, out, lse, me)


# optimize_remat: under a jax.checkpoint policy that saves matmul outputs (dots_saveable), JAX would
# replay the forward for the output and log-sum-exp, keeping every ring and tile step's scores to do so
attend.defvjp(_attend_fwd, _backward, optimize_remat=True)


def gather(x: jax.Array, ring: Ring) -> jax.Array:
    """Every device's block, [n, ...], entry ``t`` the block of device ``(i - t) mod n`` (what ring step t meets).

    A chain of ppermutes, not ``lax.all_gather``: inside a shard_map manual over this axis only,
    XLA's all-gather (and its reduce-scatter transpose) also gathers the batch over the other
    axes; ppermutes keep it split. Autodiff turns the chain into the matching reduce-scatter.
    """
    blocks = [x]
    for _ in range(ring.layout.devices - 1):
        blocks.append(_pass_on(blocks[-1], ring))
    return jnp.stack(blocks)
