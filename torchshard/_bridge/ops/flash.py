"""Memory-efficient attention: tiles of queries and keys, online softmax, a backward that recomputes each tile.

The (query block, key tile) pairs a causal mask leaves visible are folded one at a time in a
``lax.scan`` (its ``known_trip_count`` weighs it in `torchshard._hlo.costs`): those it cuts are
masked, those it hides are never visited. The custom VJP keeps only q, k, v, the output and the
per-row log-sum-exp (f32) for the backward, which recomputes each tile's scores, so no
``s × t`` score matrix is ever saved: a remat policy such as ``dots_saveable`` sees no scores to
keep, and the temporaries scale with one tile per (batch, head).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from torchshard._bridge.ops import online_softmax

Stats = tuple[jax.Array, jax.Array, jax.Array]  # running max, running sum, running weighted values (all f32)
Grads = tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]  # dq, dk, dv, dbias (f32)
Index = jax.Array | int
# the name scope of one tile's work: what its instructions pass among themselves a fused kernel keeps on
# chip, which `torchshard._hlo.costs` counts apart from the memory traffic
TILE_SCOPE = "attention_tile"
# the name scope of the scores the backward recomputes: rematerialised work, counted once in MFU
RECOMPUTE_SCOPE = "recomputed_scores"


def tile_size(length: int) -> int:
    """Positions per tile for a run of ``length``: a divisor from 64 up to 64 (≤ 256), 128 (≤ 2048), length/16 ≤ 512.

    Measured fwd+bwd of causal attention (XLA on CPU, against the former lowering's 4 or 8 query
    blocks with materialised scores): [16, 8, 256, 64] 64² tiles 0.84×, 128² 0.94×; [4, 8, 1024, 64]
    64² 0.67×, 128² 0.57×, 256² 0.67×; [2, 8, 2048, 64] 64² 0.48×, 128² 0.35×, 512² 0.65×. Longer
    runs take larger tiles: fewer loop steps, less traffic of the running statistics. A length
    with no divisor from 64 up is one tile.

    Examples:
        >>> tile_size(8192), tile_size(2048), tile_size(256), tile_size(100)
        (512, 128, 64, 100)
    """
    if length <= 0:
        return 1  # nothing to tile (an empty sequence never reaches the kernel; this keeps the arithmetic defined)
    most = 64 if length <= 256 else max(128, min(512, length // 16))
    for n in range(-(-length // most), length // 64 + 1):
        if length % n == 0:
            return length // n
    return length


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Query rows per block, keys per tile, and whether torch's top-left causal mask applies."""

    rows: int
    keys: int
    causal: bool

    def pairs(self, seq: int, keys: int) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The (query block, key tile) pairs a causal mask leaves whole, and those it cuts (all whole if not causal)."""
        blocks = [(i, j) for i in range(seq // self.rows) for j in range(keys // self.keys)]
        if not self.causal:
            return tuple(blocks), ()
        whole = tuple((i, j) for i, j in blocks if (j + 1) * self.keys - 1 <= i * self.rows)
        cut = tuple((i, j) for i, j in blocks if j * self.keys <= (i + 1) * self.rows - 1 and (i, j) not in whole)
        return whole, cut


def _slice(x: jax.Array, start: Index, size: int, axis: int) -> jax.Array:
    """``size`` positions from ``start`` along ``axis``; all of it where ``x`` broadcasts there (size 1)."""
    return x if x.shape[axis] == 1 else jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _tile(x: jax.Array | None, rows: tuple[Index, int], cols: tuple[Index, int]) -> jax.Array | None:
    """The tile of a mask or bias (broadcastable to [b, kv, g, s, t]) at query ``rows`` and key ``cols``."""
    return None if x is None else _slice(_slice(x, *rows, 3), *cols, 4)


def _add(total: jax.Array, part: jax.Array, start: Index, axis: int) -> jax.Array:
    """``total`` with ``part`` added at ``start`` along ``axis`` (in place inside a loop)."""
    if total.shape[axis] == part.shape[axis]:
        return total + part
    here = jax.lax.dynamic_slice_in_dim(total, start, part.shape[axis], axis=axis)
    return jax.lax.dynamic_update_slice_in_dim(total, here + part, start, axis=axis)


def _scores(
    tiling: Tiling,
    masked: bool,
    i: Index,
    j: Index,
    q: jax.Array,
    k: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
) -> jax.Array:
    """f32 scores of query block ``i`` against key tile ``j``; -inf where the mask (or causality if masked) hides."""
    rows, cols = (i * tiling.rows, tiling.rows), (j * tiling.keys, tiling.keys)
    s = jnp.einsum("bkgqh,bksh->bkgqs", q, k, preferred_element_type=jnp.float32)
    if (b := _tile(bias, rows, cols)) is not None:
        s = s + b.astype(jnp.float32)
    keep = _tile(mask, rows, cols)
    if masked and tiling.causal:
        row = jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0) + rows[0]
        causal = row >= jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1) + cols[0]
        keep = causal if keep is None else keep & causal
    return s if keep is None else online_softmax.masked(s, keep)


def _each_pair(pairs: tuple[tuple[int, int], ...], step: Callable[[Any, Index, Index], Any], carry: Any) -> Any:
    """``carry = step(carry, i, j)`` over ``pairs``: a scan when there are several."""
    if len(pairs) == 1:
        return step(carry, *pairs[0])
    if pairs:
        carry = jax.lax.scan(lambda c, ij: (step(c, ij[0], ij[1]), None), carry, jnp.asarray(pairs, jnp.int32))[0]
    return carry


@jax.named_scope(TILE_SCOPE)
def _fold(tiling: Tiling, masked: bool, tensors: tuple, stats: Stats, i: Index, j: Index) -> Stats:
    """Key tile ``j`` folded into query block ``i``'s running (max, sum, weighted values)."""
    q, k, v, mask, bias = tensors
    rows, cols = (i * tiling.rows, tiling.rows, 3), (j * tiling.keys, tiling.keys, 2)
    sliced = tuple(_slice(x, *rows) for x in stats)
    s = _scores(tiling, masked, i, j, _slice(q, *rows), _slice(k, *cols), mask, bias)
    m, total, acc = online_softmax.fold(sliced, s, _slice(v, *cols))  # type: ignore[arg-type]
    put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=rows[0], axis=3)
    return put(stats[0], m), put(stats[1], total), put(stats[2], acc)


def _forward(tiling: Tiling, q, k, v, mask, bias) -> tuple[jax.Array, jax.Array]:
    """(output, log-sum-exp) of every query row."""
    f32 = jnp.float32
    rows = q.shape[:-1]  # the values' head dim may differ from the queries' (MLA: 128 against 192)
    stats = (jnp.full(rows, -jnp.inf, f32), jnp.zeros(rows, f32), jnp.zeros((*rows, v.shape[-1]), f32))
    whole, cut = tiling.pairs(q.shape[3], k.shape[2])
    for pairs, masked in ((whole, False), (cut, True)):
        stats = _each_pair(pairs, functools.partial(_fold, tiling, masked, (q, k, v, mask, bias)), stats)
    m, total, acc = stats
    seen = total > 0  # rows that may attend to no key: torch's SDPA gives them zeros, not a mean of values
    total = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / total[..., None], 0.0)
    return out.astype(q.dtype), jnp.where(seen, m + jnp.log(total), jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(
    tiling: Tiling, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, bias: jax.Array | None
) -> jax.Array:
    """softmax(q·kᵀ + bias, masked)·v of [b, kv, g, s, d] queries (scaled), [b, kv, t, d] keys and [b, kv, t, e] values.

    ``mask`` (bool) and ``bias`` (float) broadcast to [b, kv, g, s, t]; ``s`` and ``t`` divide by
    ``tiling.rows`` and ``tiling.keys``. Rows that see no key give zeros, as torch's SDPA does.

    Examples:
        >>> q, kv = jnp.ones((1, 2, 1, 128, 8)), jnp.ones((1, 2, 128, 8))
        >>> attend(Tiling(64, 64, causal=True), q, kv, kv, None, None).shape
        (1, 2, 1, 128, 8)
    """
    return _forward(tiling, q, k, v, mask, bias)[0]


def _attend_fwd(tiling: Tiling, q, k, v, mask, bias):
    out, lse = _forward(tiling, q, k, v, mask, bias)
    return out, (q, k, v, mask, bias, out, lse)


@jax.named_scope(TILE_SCOPE)
def _unfold(tiling: Tiling, masked: bool, tensors: tuple, grads: Grads, i: Index, j: Index) -> Grads:
    """Pair (``i``, ``j``)'s share of dq, dk, dv and the bias' gradient, from its recomputed scores."""
    q, k, v, mask, bias, do, lse, delta = tensors
    dq, dk, dv, dbias = grads
    rows, cols = (i * tiling.rows, tiling.rows, 3), (j * tiling.keys, tiling.keys, 2)
    qi, doi, kj, vj = _slice(q, *rows), _slice(do, *rows), _slice(k, *cols), _slice(v, *cols)
    with jax.named_scope(RECOMPUTE_SCOPE):  # with its exp: XLA names a fused matmul by its fusion's last op
        p = online_softmax.probabilities(_scores(tiling, masked, i, j, qi, kj, mask, bias), _slice(lse, *rows))
    dqi, dkj, dvj, ds = online_softmax.unfold(p, _slice(delta, *rows), qi, kj, vj, doi)
    dq, dk, dv = _add(dq, dqi, rows[0], 3), _add(dk, dkj, cols[0], 2), _add(dv, dvj, cols[0], 2)
    if dbias is not None:  # summed over the dims the bias broadcasts
        summed = tuple(d for d in range(5) if dbias.shape[d] == 1 < ds.shape[d])
        dbias = _bias_add(dbias, ds.sum(summed, keepdims=True), rows[0], cols[0])
    return dq, dk, dv, dbias


def _bias_add(dbias: jax.Array, part: jax.Array, row: Index, col: Index) -> jax.Array:
    """``part`` (a tile's score gradient, broadcast dims summed) added to the bias' gradient at (``row``, ``col``)."""
    if dbias.shape[3] == part.shape[3] and dbias.shape[4] == part.shape[4]:
        return dbias + part
    start = [0, 0, 0, row if dbias.shape[3] > 1 else 0, col if dbias.shape[4] > 1 else 0]
    here = jax.lax.dynamic_slice(dbias, start, part.shape)
    return jax.lax.dynamic_update_slice(dbias, here + part, start)


def _attend_bwd(tiling: Tiling, res: tuple, do: jax.Array):
    q, k, v, mask, bias, out, lse = res
    delta = jnp.einsum("bkgqh,bkgqh->bkgq", do, out, preferred_element_type=jnp.float32)
    f32 = jnp.float32
    dbias = None if bias is None else jnp.zeros(bias.shape, f32)
    grads = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32), dbias)
    tensors = (q, k, v, mask, bias, do, lse, delta)
    whole, cut = tiling.pairs(q.shape[3], k.shape[2])
    for pairs, masked in ((whole, False), (cut, True)):
        grads = _each_pair(pairs, functools.partial(_unfold, tiling, masked, tensors), grads)
    dq, dk, dv, dbias = grads
    dbias = None if bias is None or dbias is None else dbias.astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dbias


# optimize_remat: under a jax.checkpoint policy that saves matmul outputs (dots_saveable), JAX would
# replay the forward for the output and log-sum-exp, keeping every tile's scores to do so
attend.defvjp(_attend_fwd, _attend_bwd, optimize_remat=True)
