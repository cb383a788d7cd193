"""The 1F1B pipeline schedule: forwards and backwards interleaved in one loop, the loss at the last stage.

Tick ``t`` (every stage runs every tick, each on its own devices): stage ``s`` runs the forward of
micro-batch ``t - s`` and the backward of micro-batch ``t - (2S-2-s)``. The last stage's forward of
micro-batch ``i`` feeds the loss tail (what the model does after the stack, and ``loss_fn``) in the
same tick, whose gradient starts that micro-batch's backward there at once. A stage keeps the
forward's vjp residuals of each micro-batch in flight (at most ``2S-1``; none of them recomputed)
in a ring of slots; residuals that depend only on the weights are computed once. The loop runs in
three phases so that no tick computes a forward or a backward no stage needs: ``S-1`` ticks of
forwards only (the fill), ``M`` ticks of both, ``S-1`` of backwards only (the drain).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError
from torchshard._strategies.pipeline.loop import (
    LayerFn,
    batch_axes,
    column_mask,
    copies_for,
    from_microbatches,
    gathered_copies,
    narrowed,
    per_stage,
    reordered,
    split_with_rows,
    to_microbatches,
)
from torchshard._strategies.pipeline.residuals import Residuals, residuals
from torchshard._strategies.pipeline.stage_kernel import StageKernel
from torchshard._strategies.pipeline.stages import Stages

# tail(micro-batch index, the stack's output for it) -> (what the step sums over micro-batches, d output)
Tail = Callable[[jax.Array, jax.Array], tuple[Any, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Result:
    """What one 1F1B step computed: the tail's sums, the stack's gradients and the stack input's."""

    sums: Any  # the tail's first output summed over the micro-batches
    weights: dict[str, jax.Array]  # d trainable stacked weights, [L, ...]
    h: jax.Array  # d the stack's input, [B, ...]
    others: tuple[jax.Array | None, ...]  # d each other call array (None for those not floating)


def floating(x: jax.Array) -> bool:
    """Whether ``x`` is a float array: the arrays a backward differentiates (the rest are passed through)."""
    return jnp.issubdtype(x.dtype, jnp.floating)


def _masked(valid: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    return jnp.where(column_mask(valid, new.ndim), new, old)


def write_slot(ring: jax.Array, new: jax.Array, slot: jax.Array, valid: jax.Array) -> jax.Array:
    """Each stage's ``new`` into its slot of ``ring`` ``[S, R, ...]`` where valid."""

    def one(r, n, i, v):
        return jax.lax.dynamic_update_index_in_dim(r, jnp.where(v, n, r[i]), i, 0)

    return jax.vmap(one)(ring, new, slot, valid)


def read_slot(ring: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.vmap(lambda r, i: jax.lax.dynamic_index_in_dim(r, i, 0, keepdims=False))(ring, slot)


@dataclasses.dataclass(frozen=True)
class TickLoop:
    """The loop's constant arrays and how a tick moves its carry."""

    kernel: StageKernel
    res: Residuals
    weights: dict[str, jax.Array]  # [S, chunk, ...]
    fixed: list[jax.Array]  # the residuals that depend only on the weights, [S, ...]
    micro: jax.Array  # the stack's input, [M, mb, ...]
    split: tuple[jax.Array, ...]  # [M, mb, ...]
    whole: tuple[jax.Array, ...]
    key: jax.Array
    tail: Tail

    @property
    def spec(self) -> Stages:
        return self.kernel.spec

    @property
    def shard_dim(self) -> Any:
        """How the copies' dim (after the stage dim) is laid: over the batch axes, if there are copies."""
        return batch_axes(self.spec) if self.kernel.shards > 1 else None

    def on_stages(self, x: jax.Array, *dims: Any) -> jax.Array:
        spec = PartitionSpec(self.spec.axis, *dims, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1 - len(dims))))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.spec.mesh, spec))

    def shift(self, x: jax.Array, by: int) -> jax.Array:
        """Stage s's array to stage s+by (round the ring): one collective-permute."""
        s, axis = self.spec.stages, self.spec.axis
        move = jax.shard_map(
            lambda a: jax.lax.ppermute(a, axis, [(i, (i + by) % s) for i in range(s)]),
            mesh=self.spec.mesh,
            in_specs=PartitionSpec(axis),
            out_specs=PartitionSpec(axis),
            axis_names={axis},
        )
        return self.on_stages(move(x), self.spec.batch)

    def keys(self, t: jax.Array) -> jax.Array:
        return jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(self.key, t), i))(jnp.arange(self.spec.stages))

    @property
    def slots(self) -> int:
        """The ring's slots: at most the micro-batches a stage has in flight (``2S-1``)."""
        return min(2 * self.spec.stages - 1, self.spec.microbatches)

    def tick(self, carry: dict[str, Any], t: jax.Array, *, forward: bool, backward: bool):
        stage = jnp.arange(self.spec.stages)
        carry, out = self.forwards(carry, t) if forward else (carry, None)
        if backward:
            carry, g = self.with_loss(carry, t, out)
            carry = self.backward(carry, g, t - (2 * self.spec.stages - 2 - stage))
        if out is not None:
            carry["h"] = self.shift(out, 1)
        return carry, None

    def forwards(self, carry: dict[str, Any], t: jax.Array) -> tuple[dict[str, Any], jax.Array]:
        """Stage s's forward of micro-batch t-s, its residuals into the ring: (carry, every stage's output)."""
        m, stage = self.spec.microbatches, jnp.arange(self.spec.stages)
        j = t - stage
        first = jax.lax.dynamic_index_in_dim(self.micro, jnp.clip(t, 0, m - 1), 0, keepdims=False)
        h = self.on_stages(jnp.where(column_mask(stage == 0, carry["h"].ndim), first, carry["h"]), self.spec.batch)
        split = tuple(per_stage(x, jnp.clip(j, 0, m - 1)) for x in self.split)
        whole = tuple(self.whole)
        fwd = lambda w, h, sp, k: self.kernel.stage_forward(self.res, w, h, sp, whole, k)  # noqa: E731
        out, kept = self.kernel.vmapped(fwd, self.weights, h, split, self.keys(t))
        valid = (j >= 0) & (j < m)
        carry["ring"] = [
            self.on_stages(write_slot(r, k, j % self.slots, valid), None, self.shard_dim)
            for r, k in zip(carry["ring"], kept, strict=True)
        ]
        return carry, out

    def with_loss(self, carry: dict[str, Any], t: jax.Array, out: jax.Array | None) -> tuple[dict[str, Any], Any]:
        """The gradient each stage's backward starts from: the next stage's; in a tick with forwards, the last
        stage's is the loss tail's on its output of micro-batch t-S+1 (whose sums are added up)."""
        s, g = self.spec.stages, carry["g"]
        if out is None:
            return carry, g
        sums, d_out = self.tail(t - (s - 1), out[s - 1])
        carry["sums"] = jax.tree.map(jnp.add, carry["sums"], sums)
        last = column_mask(jnp.arange(s) == s - 1, g.ndim)
        return carry, self.on_stages(jnp.where(last, d_out[None], g), self.spec.batch)

    def backward(self, carry: dict[str, Any], g: jax.Array, j: jax.Array) -> dict[str, Any]:
        """Stage s's whole backward of micro-batch ``j[s]``."""
        kept = [read_slot(r, j % self.slots) for r in carry["ring"]]
        bwd = lambda fixed, kept, g: self.kernel.stage_backward(self.res, fixed, kept, g)  # noqa: E731
        d_w, d_h, dsplit, dwhole = self.kernel.vmapped(bwd, self.fixed, kept, g)
        return self.handed_back(self.accumulated(carry, j, d_w, dsplit, dwhole), j, d_h)

    def accumulated(
        self,
        carry: dict[str, Any],
        j: jax.Array,
        d_w: Mapping[str, jax.Array],
        dsplit: Sequence[jax.Array],
        dwhole: Sequence[jax.Array],
    ) -> dict[str, Any]:
        """The carry with micro-batch ``j[s]``'s weight and call-argument gradients added where it is one."""
        m = self.spec.microbatches
        valid, at = (j >= 0) & (j < m), jnp.clip(j, 0, m - 1)
        for k, d in d_w.items():
            carry["w"][k] = carry["w"][k] + _masked(valid, d, jnp.zeros_like(d))
        carry["split"] = [
            write_slot(acc, d + read_slot(acc, at), at, valid) for acc, d in zip(carry["split"], dsplit, strict=True)
        ]
        carry["whole"] = [
            acc + _masked(valid, d, jnp.zeros_like(d)) for acc, d in zip(carry["whole"], dwhole, strict=True)
        ]
        return carry

    def handed_back(self, carry: dict[str, Any], j: jax.Array, d_h: jax.Array) -> dict[str, Any]:
        """Each stage's input gradient to the previous stage; stage 0's is the stack input's, kept."""
        m = self.spec.microbatches
        first = (j >= 0) & (j < m) & (jnp.arange(self.spec.stages) == 0)
        carry["dh"] = write_slot(carry["dh"], d_h, jnp.clip(j, 0, m - 1), first)
        carry["g"] = self.shift(d_h, -1)
        return carry

    def initial(self) -> dict[str, Any]:
        """The carry before the first tick."""
        return _initial(self, slots=self.slots)

    def ticks(self, carry: dict[str, Any]) -> dict[str, Any]:
        """The three phases: ``S-1`` ticks of forwards (the fill), ``M`` of both, ``S-1`` of backwards (the drain)."""
        s, m = self.spec.stages, self.spec.microbatches
        carry = self.phase(carry, 0, s - 1, forward=True, backward=False)
        carry = self.phase(carry, s - 1, m + s - 1, forward=True, backward=True)
        return self.phase(carry, m + s - 1, m + 2 * s - 2, forward=False, backward=True)

    def phase(self, carry: dict[str, Any], start: int, stop: int, **flags: bool) -> dict[str, Any]:
        if stop <= start:
            return carry
        carry, _ = jax.lax.scan(lambda c, t: self.tick(c, t, **flags), carry, jnp.arange(start, stop))
        return carry


def run(
    spec: Stages,
    layer_fn: LayerFn,
    weights: Mapping[str, jax.Array],
    trainable: frozenset[str],
    h: jax.Array,
    others: Sequence[jax.Array],
    key: jax.Array,
    tail: Tail,
    *,
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    policy: Any = None,
    loop: type[TickLoop] = TickLoop,
) -> Result:
    """The stack and the loss tail of every micro-batch of ``h`` as a 1F1B pipeline, forward and backward.

    Args:
        spec: the resolved pipeline (one pass: ``repeats`` 1).
        layer_fn: one layer as a pure function (see `LayerFn`).
        weights: stacked arrays ``[L, ...]`` in `Stages.order`, dim 0 over the stage axis.
        trainable: the names in ``weights`` to differentiate.
        h: the stack's input ``[B, ...]``, ``B`` a multiple of ``microbatches``.
        others: the layers' other call arrays, split with ``h`` as `pipeline.run` splits them.
        key: raw RNG key; each stage and tick draws from its own fold of it.
        tail: ``(i, stack output of micro-batch i) -> (sums, d output)``, at the last stage.
        context: entered around every trace of the layers (the torch environment).
        policy: a ``jax.checkpoint`` policy for each layer (remat), or None.
        loop: the schedule of the ticks (`TickLoop`'s is 1F1B's; `zero_bubble` defers the weight gradients).
    """
    m, rows = spec.microbatches, h.shape[0]
    others = narrowed(others, rows)
    if rows % m:
        raise ShardingError(
            f"Pipeline(schedule={spec.schedule!r}): the stack's input {list(h.shape)} does not split into "
            f"microbatches={m} along dim 0; the model's code before the stack must keep the batch's rows (a multiple "
            f"of {m})"
        )
    shards = copies_for(spec, rows // m)
    try:
        carry = _looped(spec, layer_fn, weights, trainable, h, others, key, tail, context, shards, policy, loop)
    except ValueError as err:
        if shards == 1 or "spmd_axis_name cannot appear in shard_map" not in str(err):
            raise
        # a shard_map inside the layers splits the rows over the batch axes itself (expert dispatch's all-to-all)
        carry = _looped(spec, layer_fn, weights, trainable, h, others, key, tail, context, 1, policy, loop)
    d_split, d_whole = iter(carry["split"]), iter(carry["whole"])
    d_others = [
        (from_microbatches(next(d_split).sum(0)) if split_with_rows(x, rows) else next(d_whole).sum((0, 1)))
        if floating(x)
        else None
        for x in others
    ]
    # the copies' gradients summed once, here: the one reduction over the batch axes of the step
    d_weights = {k: w.sum(1).reshape(-1, *w.shape[3:]) for k, w in carry["w"].items()}
    return Result(carry["sums"], d_weights, from_microbatches(carry["dh"][0]), tuple(d_others))


def _looped(
    spec: Stages,
    layer_fn: LayerFn,
    weights: Mapping[str, jax.Array],
    trainable: frozenset[str],
    h: jax.Array,
    others: Sequence[jax.Array],
    key: jax.Array,
    tail: Tail,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
    shards: int,
    policy: Any,
    kind: type[TickLoop],
) -> dict[str, Any]:
    """The phases of the loop with ``shards`` copies of each stage's weights: the final carry."""
    m, s, rows = spec.microbatches, spec.stages, h.shape[0]
    split = tuple(to_microbatches(x, m) for x in others if split_with_rows(x, rows))
    whole = tuple(x for x in others if not split_with_rows(x, rows))
    kernel = StageKernel(
        spec,
        reordered(layer_fn, others, rows),
        trainable,
        tuple(map(floating, split)),
        tuple(map(floating, whole)),
        context,
        shards,
        policy,
    )
    blocks = {k: w.reshape(s, spec.chunk, *w.shape[1:]) for k, w in weights.items()}
    blocks = gathered_copies(spec, blocks, shards, 2) if shards > 1 else {k: w[:, None] for k, w in blocks.items()}
    micro = to_microbatches(h, m)
    # every stage on a placeholder micro-batch: its weight-only residuals (the rest is dead code), and the
    # pullback's structure, traced under the vmaps the loop traces it under
    placeholder = (
        blocks,
        jnp.zeros((s, *micro.shape[1:]), micro.dtype),
        [jnp.zeros((s, *x.shape[1:]), x.dtype) for x in split],
        jax.vmap(lambda i: key)(jnp.arange(s)),
    )
    pullbacks = lambda w, h, sp, k: kernel.pullbacks(w, h, sp, whole, k)  # noqa: E731
    with context():
        res = residuals(pullbacks, placeholder, (False, True, True, True), lead=2)
    fixed = res.split(jax.tree_util.tree_leaves(pullbacks(*placeholder)))[0]
    loop = kind(kernel, res, blocks, fixed, micro, split, whole, key, tail)
    loop = dataclasses.replace(
        loop,
        weights={k: loop.on_stages(w, loop.shard_dim) for k, w in blocks.items()},
        fixed=[loop.on_stages(f, loop.shard_dim) for f in fixed],
    )
    return loop.ticks(loop.initial())


def _initial(loop: TickLoop, *, slots: int) -> dict[str, Any]:
    """The loop's carry before the first tick: zeros, each array's dim 0 over the stages."""
    spec, s, micro, kernel, d = loop.spec, loop.spec.stages, loop.micro, loop.kernel, loop.kernel.shards
    zeros = lambda shape, dtype: jnp.zeros(shape, dtype)  # noqa: E731
    h0 = loop.on_stages(zeros((s, *micro.shape[1:]), micro.dtype), spec.batch)
    sums = jax.tree.map(lambda x: zeros(x.shape, x.dtype), jax.eval_shape(loop.tail, jnp.int32(0), micro[0])[0])
    return {
        "ring": [
            loop.on_stages(zeros((s, slots, d, *k.shape), k.dtype), None, loop.shard_dim) for k in loop.res.kept()
        ],
        "h": h0,
        "g": h0,
        "sums": sums,
        "w": {
            k: loop.on_stages(jnp.zeros_like(w), loop.shard_dim)
            for k, w in loop.weights.items()
            if k in kernel.trainable
        },
        "dh": loop.on_stages(zeros((s, *micro.shape), micro.dtype), None, spec.batch),
        "split": [loop.on_stages(zeros((s, *x.shape), x.dtype)) for x in loop.split if floating(x)],
        "whole": [loop.on_stages(zeros((s, d, *x.shape), x.dtype), loop.shard_dim) for x in loop.whole if floating(x)],
    }
