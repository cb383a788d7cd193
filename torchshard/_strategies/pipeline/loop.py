"""Pipeline parallelism: a stack of identical layers split into stages over a mesh axis, micro-batches streamed through.

The layers' weights are stacked ``[L, ...]`` with the stage axis on the layer dim, stored so that a contiguous split
gives each stage its chunks. One loop of ``repeats·M + S - 1`` iterations runs every stage on its current
micro-batch at once (``vmap`` over the stage dim: under GSPMD each device computes only its own stage), then passes
every stage's output to the next stage with a ``ppermute`` (a collective-permute). The loop steps one layer at a
time (an iteration is ``chunk`` steps), so autodiff of the loop, the backward pass, keeps one gradient accumulator
for the stack and slices each layer out of the stack again rather than keeping its slice; under ``"1f1b_remat"`` and
``"circular"`` each step is checkpointed, so the backward recomputes and differentiates one layer of one micro-batch
per stage at a time. Under FSDP or data parallelism inside the stages, weights are gathered once before the loop and
gradients reduced once after it (`gathered_copies`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError
from torchshard._bridge.vmapped import vmapped_over
from torchshard._strategies.pipeline.stages import Stages

# layer_fn(one layer's arrays, hidden state, other call arrays, key) -> (hidden state, key after)
LayerFn = Callable[[Mapping[str, jax.Array], jax.Array, Sequence[jax.Array], jax.Array], tuple[jax.Array, jax.Array]]


def to_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] → [M, B/M, ...] taking rows i, i+M, ...: each data shard keeps its own rows."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def from_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `to_microbatches`."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def narrowed(others: Sequence[jax.Array], rows: int) -> list[jax.Array]:
    """``others`` with each constant integer or boolean argument whose rows are all equal cut to one row.

    A mask the model builds from no input (transformers' causal or sliding-window mask, [B, 1, S, S])
    is a constant while traced (`index_constants_folded`); split into micro-batches it would turn into
    a traced slice, which context-parallel attention cannot read as a window. One row broadcasts over
    every micro-batch's rows and stays a constant.
    """
    out = []
    for x in others:
        if (
            split_with_rows(x, rows)
            and not isinstance(x, jax.core.Tracer)
            and not jnp.issubdtype(x.dtype, jnp.floating)
        ):
            with jax.ensure_compile_time_eval():  # evaluated now, on the constant: the result stays one
                first = x[:1]
                x = first if bool((x == first).all()) else x
        out.append(x)
    return out


def split_with_rows(x: jax.Array, rows: int) -> bool:
    # a call argument of rank ≥ 2 whose leading dim is the batch's (a mask, positions) is split with the rows;
    # rank-1 arguments (cache positions) and broadcast ones (leading dim 1) go to every micro-batch whole
    return x.ndim >= 2 and x.shape[0] == rows and rows > 1


@dataclasses.dataclass(frozen=True)
class _Loop:
    """The arrays and functions of one pipelined call, shared by every step.

    The loop runs one layer per step: step ``k`` is layer ``k mod chunk`` of every stage's chunk in
    iteration ``k // chunk``, so the stack's gradient is one accumulator that each step updates in
    place (a loop over iterations around a loop over the chunk would keep a second one per
    iteration, and autodiff would keep every layer's slice of the stack for the backward).
    """

    spec: Stages
    layer_fn: LayerFn
    weights: Mapping[str, jax.Array]  # [S, repeats, chunk, ...], or [S, chunk, ...] for one repeat
    split: tuple[jax.Array, ...]  # batch-split call arguments, [M, mb, ...]
    whole: tuple[jax.Array, ...]
    key: jax.Array
    policy: Any  # what the backward keeps of a layer (a jax.checkpoint policy)
    shards: int = (
        1  # the weights' copies over the batch axes (`gathered_copies`): each runs its own rows of a micro-batch
    )

    def constrain(self, x: jax.Array, *dims: Any) -> jax.Array:
        spec = PartitionSpec(self.spec.axis, *dims, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1 - len(dims))))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.spec.mesh, spec))

    def rotate(self, x: jax.Array) -> jax.Array:
        """Stage s's array to stage s+1 (the last stage's to stage 0): one collective-permute."""
        s, axis = self.spec.stages, self.spec.axis
        ring = [(i, (i + 1) % s) for i in range(s)]
        move = jax.shard_map(
            lambda a: jax.lax.ppermute(a, axis, ring),
            mesh=self.spec.mesh,
            in_specs=PartitionSpec(axis),
            out_specs=PartitionSpec(axis),
            axis_names={axis},
        )
        return move(x)

    def keys(self, t: jax.Array) -> jax.Array:
        """Each stage's key for iteration ``t``."""
        return jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(self.key, t), i))(jnp.arange(self.spec.stages))

    def layers(
        self,
        weights: Mapping[str, jax.Array],
        h: jax.Array,
        keys: jax.Array,
        repeat: jax.Array,
        micro: jax.Array,
        i: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """Layer ``i`` of every stage's chunk (of its ``repeat``) on its micro-batch, each stage on its own devices."""
        split = tuple(per_stage(x, micro) for x in self.split)
        d = self.shards
        at = 1 if d == 1 else 2  # [S, D, ...]: the copies' dim before the layers'
        if self.spec.repeats == 1:
            layer = {k: jnp.take(w, i, axis=at) for k, w in weights.items()}
        else:
            pick = (lambda a, r: a[r, i]) if d == 1 else (lambda a, r: a[:, r, i])
            layer = {k: jax.vmap(pick)(w, repeat) for k, w in weights.items()}
        one = lambda layer, h, split, keys: self.layer_fn(layer, h, (*split, *self.whole), keys)  # noqa: E731
        if d == 1:
            return jax.vmap(one, spmd_axis_name=self.spec.axis)(layer, h, split, keys)
        rows = h.shape[1]
        local = lambda x: x.reshape(x.shape[0], d, x.shape[1] // d, *x.shape[2:])  # noqa: E731
        h, split = local(h), tuple(local(x) for x in split)

        def per_shard(layer, h, split, key):
            # each data shard's rows of the micro-batch with its own copy of the layer: the weight gradient
            # stays a per-shard partial sum in the loop, reduced once after it; each shard draws its own masks
            keys = jax.vmap(lambda n: jax.random.fold_in(key, n))(jnp.arange(d))
            h, after = jax.vmap(one, spmd_axis_name=batch_axes(self.spec))(layer, h, split, keys)
            return h, after[0]

        h, keys = jax.vmap(per_shard, spmd_axis_name=self.spec.axis)(layer, h, split, keys)
        return h.reshape(h.shape[0], rows, *h.shape[3:]), keys

    def step(self, carry: tuple[jax.Array, jax.Array, jax.Array], k: jax.Array):
        buffer, h, keys = carry
        spec, stage = self.spec, jnp.arange(self.spec.stages)
        m, c = spec.microbatches, spec.chunk
        t, i = k // c, k % c
        # an iteration starts: stage 0 takes micro-batch t mod M, the others keep what the previous stage handed on
        first = jax.lax.dynamic_index_in_dim(buffer, t % m, 1, keepdims=False)
        h = self.constrain(jnp.where(column_mask((i == 0) & (stage == 0), h.ndim), first, h), spec.batch)
        keys = jnp.where(i == 0, self.keys(t), keys)
        # stage s runs micro-batch (t - s) mod M of repeat (t - s) // M; outside 0..repeats-1 it idles on junk
        ahead = t - stage
        repeat = jnp.clip(ahead // m, 0, spec.repeats - 1)
        layers = jax.checkpoint(self.layers, policy=self.policy, prevent_cse=False)
        h, keys = layers(self.weights, h, keys, repeat, ahead % m, i)
        if c == 1:
            buffer, h = self.hand_on(buffer, h, t)
        else:
            buffer, h = jax.lax.cond(i == c - 1, self.hand_on, lambda b, h, t: (b, h), buffer, h, t)
        return (buffer, h, keys), None

    def hand_on(self, buffer: jax.Array, h: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The end of iteration ``t``: every stage's output to the next stage; stage 0 keeps the last stage's."""
        s, m = self.spec.stages, self.spec.microbatches
        rotated = self.constrain(self.rotate(h), self.spec.batch)
        # stage 0's slot now holds the last stage's output: micro-batch t-S+1 is done with this round
        done = (t - s + 1) % m
        old = jax.lax.dynamic_index_in_dim(buffer, done, 1, keepdims=False)
        kept = jnp.where(t >= s - 1, rotated, old)
        return jax.lax.dynamic_update_index_in_dim(buffer, kept, done, 1), rotated


def column_mask(mask: jax.Array, ndim: int) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (ndim - 1))


def per_stage(x: jax.Array, index: jax.Array) -> jax.Array:
    """Stage s's slice ``x[index[s]]`` (``[S, ...]``): local on each stage's devices."""
    return jax.vmap(lambda i: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False))(index)


def _unsliced(prim: Any, *avals: Any, **__: Any) -> bool:
    # a layer's slice of the stack is not kept for the backward, which slices the stack again: kept, it would be a
    # copy of the stack (autodiff stacks a loop-invariant residual outside the loop). Nor is a complex value (a
    # rotary product): remat rounds what it keeps with reduce_precision, which refuses complex dtypes
    complex_in = any(jnp.iscomplexobj(a) for a in avals if hasattr(a, "dtype"))
    return prim not in (jax.lax.dynamic_slice_p, jax.lax.gather_p, jax.lax.complex_p) and not complex_in


def backward_policy(spec: Stages, policy: Any) -> Any:
    """What the backward keeps of each layer: ``policy`` (remat) or everything, never a slice of the stack;
    only the layer's input under a schedule that recomputes each layer in the backward (circular, 1f1b_remat)."""
    if spec.remats_each_layer:
        return jax.checkpoint_policies.nothing_saveable
    if policy is None:
        return _unsliced
    return lambda prim, *args, **params: _unsliced(prim, *args) and policy(prim, *args, **params)


def run(
    spec: Stages,
    layer_fn: LayerFn,
    params: Mapping[str, jax.Array],
    h: jax.Array,
    others: Sequence[jax.Array],
    key: jax.Array,
    *,
    policy: Any = None,
    where: str = "pipeline",
    names: Sequence[str] = (),
) -> tuple[jax.Array, jax.Array]:
    """The stack applied to ``h`` as a pipeline: ``(output, key after)``.

    Args:
        spec: the resolved pipeline.
        layer_fn: one layer as a pure function (see `LayerFn`).
        params: stacked arrays ``[L, ...]`` in `Stages.order`, dim 0 over the stage axis.
        h: the hidden state ``[B, ...]``; ``B`` must split into ``microbatches``.
        others: the layers' other call arrays; those of rank ≥ 2 with leading dim ``B`` are split
            into micro-batches with ``h``, the rest given whole to every micro-batch.
        key: raw RNG key; each stage and iteration draws from its own fold of it.
        policy: a ``jax.checkpoint`` policy for each layer's body (remat), or None.
        where: how errors name the stack.
        names: how errors name ``others`` (the layer's parameter names), if known.

    Raises:
        ShardingError: the hidden state's rows do not split into the micro-batches, or a layer fails
            on a rank-1 argument as long as the rows that went whole to every micro-batch.
    """
    rows, m = h.shape[0] if h.ndim else 0, spec.microbatches
    if h.ndim == 0 or rows % m:
        fits = m * max(1, -(-rows // m)) if h.ndim else m
        raise ShardingError(
            f"{where}: the hidden state {list(h.shape)} does not split into microbatches={m} along dim 0; "
            f"use a batch whose rows per step (after grad_accum_steps) are a multiple of {m}, e.g. {fits}"
        )
    # [L, ...] → [S, repeats, chunk, ...] ([S, chunk, ...] for one repeat): free, dim 0 is already split by stage
    blocks = (spec.stages, spec.chunk) if spec.repeats == 1 else (spec.stages, spec.repeats, spec.chunk)
    weights = {
        k: jax.lax.with_sharding_constraint(w.reshape(*blocks, *w.shape[1:]), _stage_spec(spec, w.ndim, blocks))
        for k, w in params.items()
    }
    others = narrowed(others, rows)
    split = tuple(to_microbatches(x, m) for x in others if split_with_rows(x, rows))
    whole = tuple(x for x in others if not split_with_rows(x, rows))
    loop = _Loop(spec, reordered(layer_fn, others, rows), weights, split, whole, key, backward_policy(spec, policy))
    shards = copies_for(spec, rows // m)
    try:
        try:
            buffer = _looped(loop, to_microbatches(h, m), shards, len(blocks))
        except ValueError as err:
            if shards == 1 or "spmd_axis_name cannot appear in shard_map" not in str(err):
                raise
            # a shard_map inside the layers splits the rows over the batch axes itself (expert dispatch's
            # all-to-all): the loop cannot split them too, and keeps the weights sharded (traffic per iteration)
            buffer = _looped(loop, to_microbatches(h, m), 1, len(blocks))
    except (TypeError, ValueError) as err:
        if isinstance(err, ShardingError):
            raise
        if folded := _folded_rows(h, others, names):
            raise ShardingError(_folded_rows_message(err, where, h, m, folded)) from err
        if not (whole_rows := _whole_rows(h, others, names)):
            raise
        raise ShardingError(_whole_rows_message(err, where, h, m, whole_rows)) from err
    return from_microbatches(buffer[0]), jax.random.fold_in(key, spec.iterations)


def _looped(loop: _Loop, micro: jax.Array, shards: int, lead: int) -> jax.Array:
    """The loop over every iteration's layers, with ``shards`` copies of the weights (`gathered_copies`): the buffer."""
    spec = loop.spec
    loop = dataclasses.replace(loop, weights=gathered_copies(spec, dict(loop.weights), shards, lead), shards=shards)
    buffer = loop.constrain(jnp.broadcast_to(micro, (spec.stages, *micro.shape)), None, spec.batch)
    shift = loop.constrain(jnp.zeros((spec.stages, *micro.shape[1:]), micro.dtype), spec.batch)
    steps = jnp.arange(spec.iterations * spec.chunk)
    with contextlib.ExitStack() as vmapped:  # shard_maps inside the layers (context-parallel attention) take the
        for axis in (spec.axis, *(batch_axes(spec) if shards > 1 else ())):  # vmapped axes as manual ones
            vmapped.enter_context(vmapped_over(axis))
        (buffer, _, _), _ = jax.lax.scan(loop.step, (buffer, shift, loop.keys(jnp.int32(0))), steps)
    return buffer


def _named(others: Sequence[jax.Array], names: Sequence[str]) -> list[tuple[str, jax.Array]]:
    """The call arguments with their parameter names, "argument #i" past the named ones."""
    named = [*names, *(f"argument #{i + 1}" for i in range(len(names), len(others)))]
    return list(zip(named, others, strict=False))


def _whole_rows(h: jax.Array, others: Sequence[jax.Array], names: Sequence[str]) -> list[str]:
    """The rank-1 call arguments as long as the rows, which went whole to every micro-batch: ``name dtype[shape]``."""
    return [
        f"{n} ({x.dtype}{list(x.shape)})"
        for n, x in _named(others, names)
        if x.ndim == 1 and not split_with_rows(x, h.shape[0]) and x.shape[0] == h.shape[0]
    ]


def _folded_rows(h: jax.Array, others: Sequence[jax.Array], names: Sequence[str]) -> list[str]:
    """Call arguments whose leading dim is a multiple of the rows (folded with another): ``name dtype[shape]``."""
    rows = h.shape[0]
    return [
        f"{n} ({x.dtype}{list(x.shape)}, {rows} rows × {x.shape[0] // rows})"
        for n, x in _named(others, names)
        if x.ndim >= 2 and rows > 1 and x.shape[0] > rows and x.shape[0] % rows == 0
    ]


def _failed_after_split(err: BaseException, where: str, h: jax.Array, m: int, whole: Sequence[str]) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return (
        f"{where}: a layer failed ({type(err).__name__}: {first}) after the pipeline split the hidden state "
        f"{list(h.shape)} along dim 0 into microbatches={m} of {h.shape[0] // m} rows and gave {', '.join(whole)} "
        f"whole to every micro-batch: "
    )


def _folded_rows_message(err: BaseException, where: str, h: jax.Array, m: int, folded: Sequence[str]) -> str:
    # Split only what leads with the rows: a leading dim that is merely a multiple of them is as often a
    # table over positions (rotary cos/sin [seq, dim]), which every micro-batch needs whole
    return _failed_after_split(err, where, h, m, folded) + (
        "its leading dim folds the rows with another dim (as Bloom's ALiBi bias, [batch × heads, 1, seq]), which "
        "a pipeline cannot tell from a table over positions. Pass it with the rows leading ([batch, heads, ...]), "
        "or leave this stack unpipelined"
    )


def _whole_rows_message(err: BaseException, where: str, h: jax.Array, m: int, whole: Sequence[str]) -> str:
    rows = h.shape[0]
    return _failed_after_split(err, where, h, m, whole) + (
        f"a rank-1 argument is taken as per-position (like cache_position), not per-row. "
        f"If the rows are independent samples, give it a trailing dim (x[:, None], shape [{rows}, 1]) so it is "
        f"split with them. If they are one flat token stream (tokens [T] with positions [T]), a micro-batch would "
        f"cut the sequence and tokens could attend only within it: feed rows of sequences instead, tokens [B, S] "
        f"with positions [B, S], which split whole sequences"
    )


def batch_axes(spec: Stages) -> tuple[str, ...]:
    """The mesh axes a micro-batch's rows are sharded over, as a tuple."""
    return () if spec.batch is None else (spec.batch,) if isinstance(spec.batch, str) else tuple(spec.batch)


def copies_for(spec: Stages, rows: int) -> int:
    """Copies of the stage's weights: one per shard of the batch axes if a micro-batch's ``rows`` split over them."""
    d = math.prod(spec.mesh.shape[axis] for axis in batch_axes(spec))
    return d if d > 1 and rows % d == 0 else 1


def gathered_copies(spec: Stages, weights: dict[str, jax.Array], shards: int, lead: int) -> dict[str, jax.Array]:
    """Each stage's weights gathered ONCE per step, before the loop: ``[S, D, ...]``, copy ``d`` on shard ``d``.

    Left to itself, GSPMD all-gathers a weight sharded over the batch axes (FSDP) in every loop
    iteration, and all-reduces its gradient there too. With a copy per shard of the batch axes (that
    dim laid on them) the backward accumulates each copy's gradient from its own rows in the loop's
    carry, and the broadcast's transpose sums the copies once, after the loop. It costs a full copy
    of the stage's weights and of their gradient per device, instead of a ``1/D`` shard.
    """
    if shards == 1:
        return weights
    out = {}
    for k, w in weights.items():
        copies = jnp.broadcast_to(w[:, None], (w.shape[0], shards, *w.shape[1:]))
        dims = [spec.axis, batch_axes(spec), *[None] * (lead - 1), *[PartitionSpec.UNCONSTRAINED] * (w.ndim - lead)]
        out[k] = jax.lax.with_sharding_constraint(copies, NamedSharding(spec.mesh, PartitionSpec(*dims)))
    return out


def _stage_spec(spec: Stages, ndim: int, blocks: tuple[int, ...]) -> NamedSharding:
    # the layer's own dims keep the plan's sharding over the other axes
    rest = [PartitionSpec.UNCONSTRAINED] * (ndim - 1)
    return NamedSharding(spec.mesh, PartitionSpec(spec.axis, *[None] * (len(blocks) - 1), *rest))


def reordered(layer_fn: LayerFn, others: Sequence[jax.Array], rows: int) -> LayerFn:
    """``layer_fn`` taking (split..., whole...) call arrays back in the order the layer was called with."""
    by_batch = [split_with_rows(x, rows) for x in others]

    def call(layer, h, grouped, key):
        split, whole = iter(grouped[: sum(by_batch)]), iter(grouped[sum(by_batch) :])
        return layer_fn(layer, h, [next(split) if b else next(whole) for b in by_batch], key)

    return call
