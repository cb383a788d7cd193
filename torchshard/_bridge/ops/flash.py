"""Memory-efficient attention: tiles of queries and keys, online softmax, a backward that recomputes each tile.

Query blocks are unrolled; the keys a block sees in full are folded a tile at a time in a
``lax.scan`` (its ``known_trip_count`` weighs it in `torchshard._report.costs`), the tiles a causal
mask cuts are unrolled and masked, those it hides entirely are skipped. The custom VJP keeps only
q, k, v, the output and the per-row log-sum-exp (f32) for the backward, so no ``s × t`` score
matrix is ever saved: a remat policy such as ``dots_saveable`` sees no scores to keep, and the
temporaries scale with one ``tile × tile`` block per (batch, head).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

Stats = tuple[jax.Array, jax.Array, jax.Array]  # running max, running sum, running weighted values (all f32)
Grads = tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]  # dq of a query block, dk, dv, dbias (f32)
# the most query rows (and keys) per tile: a tile's scores are tile² f32 per (batch, head)
TILE = 512


def tiles(length: int, most: int = TILE) -> int:
    """How many equal tiles of at most ``most`` (and at least 64) positions ``length`` is cut into; 1 if none divide.

    Example:
        >>> tiles(8192), tiles(256), tiles(100), tiles(4096, most=1024)
        (16, 1, 1, 4)
    """
    for n in range(-(-length // most), length // min(64, most) + 1):
        if length % n == 0:
            return n
    return 1


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Rows per query block, keys per tile, and whether torch's top-left causal mask applies."""

    rows: int
    keys: int
    causal: bool

    def visible(self, block: int, key_tiles: int) -> tuple[int, int]:
        """(tiles query block ``block`` sees whole, tiles it sees at all): the rest of the tiles are masked out."""
        if not self.causal:
            return key_tiles, key_tiles
        first, last = block * self.rows, block * self.rows + self.rows - 1
        return min((first + 1) // self.keys, key_tiles), min(last // self.keys + 1, key_tiles)


def _cols(x: jax.Array | None, start: jax.Array | int, size: int) -> jax.Array | None:
    """The keys ``start...start+size`` of a mask or bias broadcastable to [b, kv, g, s, t] (all when broadcast)."""
    if x is None or x.shape[4] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=4)


def _rows(x: jax.Array | None, start: int, size: int) -> jax.Array | None:
    return x if x is None or x.shape[3] == 1 else x[:, :, :, start : start + size]


def _scores(q: jax.Array, k: jax.Array, mask: jax.Array | None, bias: jax.Array | None,
            diagonal: tuple[int, jax.Array | int] | None) -> jax.Array:  # fmt: skip
    """f32 scores of a query block against a key tile, -inf where masked; ``diagonal``: (row, key) starts, causal."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", q, k, preferred_element_type=jnp.float32)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    keep = mask
    if diagonal is not None:
        rows = jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0) + diagonal[0]
        causal = rows >= jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1) + diagonal[1]
        keep = causal if keep is None else keep & causal
    return s if keep is None else jnp.where(keep, s, -jnp.inf)


def _fold(stats: Stats, s: jax.Array, v: jax.Array) -> Stats:
    """One tile of scores folded into a query block's running (max, sum, weighted values)."""
    m, total, acc = stats
    m_new = jnp.maximum(m, s.max(-1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet stays at zero weight
    p = jnp.exp(s - shift[..., None])
    alpha = jnp.exp(m - shift)
    pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * total + p.sum(-1), alpha[..., None] * acc + pv


def _each_tile(tiling: Tiling, block: int, key_tiles: int, step, carry):
    """``carry = step(carry, tile, masked)`` over the key tiles query block ``block`` sees: whole ones scanned."""
    whole, seen = tiling.visible(block, key_tiles)
    if whole == 1:
        carry = step(carry, 0, False)
    elif whole > 1:
        carry = jax.lax.scan(lambda c, j: (step(c, j, False), None), carry, jnp.arange(whole))[0]
    for j in range(whole, seen):
        carry = step(carry, j, True)
    return carry


def _forward_block(tiling: Tiling, block: int, q: jax.Array, k: jax.Array, v: jax.Array, mask, bias):
    """(output, log-sum-exp) of query block ``block`` (q already cut to it; mask and bias too)."""
    size, start = tiling.keys, block * tiling.rows

    def step(stats: Stats, j, masked: bool) -> Stats:
        kj, vj = (jax.lax.dynamic_slice_in_dim(x, j * size, size, axis=2) for x in (k, v))
        diagonal = (start, j * size) if masked and tiling.causal else None
        return _fold(stats, _scores(q, kj, _cols(mask, j * size, size), _cols(bias, j * size, size), diagonal), vj)

    f32 = jnp.float32
    fresh = (jnp.full(q.shape[:-1], -jnp.inf, f32), jnp.zeros(q.shape[:-1], f32), jnp.zeros(q.shape, f32))
    m, total, acc = _each_tile(tiling, block, k.shape[2] // size, step, fresh)
    seen = total > 0  # rows that may attend to no key: torch's SDPA gives them zeros, not a mean of values
    out = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
    return out.astype(q.dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)


def _forward(tiling: Tiling, q, k, v, mask, bias) -> tuple[jax.Array, jax.Array]:
    outs, lses = [], []
    for i in range(q.shape[3] // tiling.rows):
        cut = functools.partial(_rows, start=i * tiling.rows, size=tiling.rows)
        out, lse = _forward_block(tiling, i, cut(q), k, v, cut(mask), cut(bias))
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=3), jnp.concatenate(lses, axis=3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(tiling: Tiling, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
           bias: jax.Array | None) -> jax.Array:  # fmt: skip
    """softmax(q·kᵀ + bias, masked)·v of [b, kv, g, s, d] queries (scaled) and [b, kv, t, d] keys and values.

    ``mask`` (bool) and ``bias`` (float) broadcast to [b, kv, g, s, t]; ``s`` and ``t`` divide by
    ``tiling.rows`` and ``tiling.keys``. Rows that see no key give zeros, as torch's SDPA does.

    Example:
        >>> q, kv = jnp.ones((1, 2, 1, 128, 8)), jnp.ones((1, 2, 128, 8))
        >>> attend(Tiling(64, 64, causal=True), q, kv, kv, None, None).shape
        (1, 2, 1, 128, 8)
    """
    return _forward(tiling, q, k, v, mask, bias)[0]


def _attend_fwd(tiling: Tiling, q, k, v, mask, bias):
    out, lse = _forward(tiling, q, k, v, mask, bias)
    return out, (q, k, v, mask, bias, out, lse)


def _backward_block(tiling: Tiling, block: int, saved: tuple, grads: Grads, mask, bias) -> Grads:
    """Query block ``block``'s dq, and its share of dk, dv and the bias' gradient, from recomputed tiles."""
    q, k, v, do, lse, delta = saved
    size, start = tiling.keys, block * tiling.rows

    def step(grads: Grads, j, masked: bool) -> Grads:
        dq, dk, dv, dbias = grads
        kj, vj = (jax.lax.dynamic_slice_in_dim(x, j * size, size, axis=2) for x in (k, v))
        bias_j = _cols(bias, j * size, size)
        diagonal = (start, j * size) if masked and tiling.causal else None
        p = jnp.exp(_scores(q, kj, _cols(mask, j * size, size), bias_j, diagonal) - lse[..., None])
        dp = jnp.einsum("bkgqh,bksh->bkgqs", do, vj, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[..., None])
        dq = dq + jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32)
        dk = _add_cols(dk, jnp.einsum("bkgqs,bkgqh->bksh", ds.astype(q.dtype), q,
                                      preferred_element_type=jnp.float32), j * size, 2)  # fmt: skip
        dv = _add_cols(dv, jnp.einsum("bkgqs,bkgqh->bksh", p.astype(do.dtype), do,
                                      preferred_element_type=jnp.float32), j * size, 2)  # fmt: skip
        if dbias is not None:
            dbias = _add_bias_grad(dbias, ds, j * size, size)
        return dq, dk, dv, dbias

    return _each_tile(tiling, block, k.shape[2] // size, step, grads)


def _add_cols(total: jax.Array, part: jax.Array, start: jax.Array | int, axis: int) -> jax.Array:
    here = jax.lax.dynamic_slice_in_dim(total, start, part.shape[axis], axis=axis)
    return jax.lax.dynamic_update_slice_in_dim(total, here + part, start, axis=axis)


def _add_bias_grad(dbias: jax.Array, ds: jax.Array, col: jax.Array | int, cols: int) -> jax.Array:
    """Adds a tile's score gradient, summed over the dims the bias broadcasts, into the bias' gradient."""
    broadcast = tuple(d for d in range(5) if dbias.shape[d] == 1 and ds.shape[d] > 1)
    part = ds.sum(axis=broadcast, keepdims=True) if broadcast else ds
    return _add_cols(dbias, part, col, 4) if dbias.shape[4] > 1 else dbias + part


def _attend_bwd(tiling: Tiling, res: tuple, do: jax.Array):
    q, k, v, mask, bias, out, lse = res
    delta = jnp.einsum("bkgqh,bkgqh->bkgq", do, out, preferred_element_type=jnp.float32)
    f32 = jnp.float32
    dk, dv = jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    per_block = bias is not None and bias.shape[3] > 1  # a bias over query rows: each block owns its rows
    dbias = None if bias is None or per_block else jnp.zeros(bias.shape, f32)
    dqs, dbiases = [], []
    for i in range(q.shape[3] // tiling.rows):
        cut = functools.partial(_rows, start=i * tiling.rows, size=tiling.rows)
        saved = (cut(q), k, v, cut(do), cut(lse[..., None])[..., 0], cut(delta[..., None])[..., 0])
        if per_block:
            dbias = jnp.zeros(cut(bias).shape, f32)
        grads = (jnp.zeros(saved[0].shape, f32), dk, dv, dbias)
        dq, dk, dv, dbias = _backward_block(tiling, i, saved, grads, cut(mask), cut(bias))
        dqs.append(dq)
        dbiases.append(dbias)
    dq = jnp.concatenate(dqs, axis=3).astype(q.dtype)
    if bias is not None:
        dbias = (jnp.concatenate(dbiases, axis=3) if per_block else dbias).astype(bias.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, dbias


attend.defvjp(_attend_fwd, _attend_bwd)
