"""Pipeline parallelism: a stack of identical layers split into stages over a mesh axis, micro-batches streamed through.

The layers' weights are stacked ``[L, ...]`` with the stage axis on the layer dim, stored so that a contiguous split
gives each stage its chunks. One loop of ``repeats·M + S - 1`` iterations runs every stage on its current
micro-batch at once (``vmap`` over the stage dim: under GSPMD each device computes only its own stage), then passes
every stage's output to the next stage with a ``ppermute`` (a collective-permute). The loop steps one layer at a
time (an iteration is ``chunk`` steps), so autodiff of the loop, the backward pass, keeps one gradient accumulator
for the stack and slices each layer out of the stack again rather than keeping its slice; under ``"1f1b_remat"`` and
``"circular"`` each step is checkpointed, so the backward recomputes and differentiates one layer of one micro-batch
per stage at a time. Under FSDP or data parallelism inside the stages, weights are gathered once before the loop and
gradients reduced once after it (`_gathered`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError
from torchshard._base.schedule import bubble_fraction
from torchshard._base.validate import describe_mesh, int_problems, raise_for_arguments, regex_problem
from torchshard._bridge.vmapped import vmapped_over

SCHEDULES = ("gpipe", "circular", "1f1b", "1f1b_remat", "zero_bubble")
# layer_fn(one layer's arrays, hidden state, other call arrays, key) -> (hidden state, key after)
LayerFn = Callable[[Mapping[str, jax.Array], jax.Array, Sequence[jax.Array], jax.Array], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism over a model's stack of identical layers, for ``Trainer(..., pipeline=...)``.

    The stack (the ModuleList ``scan_layers=True`` finds, or the one ``layers`` names) is split into ``S * repeats``
    contiguous chunks of layers, ``S = mesh.shape[axis]``; a chunk's weights live only on the devices at its index
    of ``axis`` (sharded over the other axes as the plan says). Each batch is split into ``microbatches`` along dim
    0 and streamed through the stages; activations move between stages with ``ppermute``. Embeddings run before the
    loop; final norm, head and loss after it, or under ``"1f1b"`` in it, per micro-batch.

    Args:
        axis: the mesh axis the stages are laid along.
        microbatches: micro-batches per batch (at least the number of stages; default: one per stage).
        schedule: ``"gpipe"``: all forwards, then the backward by autodiff; ``"circular"``: chunk ``j``
            on stage ``j mod S``, and micro-batches go ``repeats`` times round the stages, which shrinks
            the idle fraction to ``(S-1)/(repeats*M + S-1)``; ``"1f1b"``: a forward and a backward per
            stage per iteration, each micro-batch's loss at the last stage (the step's loss is their
            mean, as with ``grad_accum_steps``): activations of ≤ ``2S-1`` micro-batches, no recompute;
            ``"1f1b_remat"``: gpipe's order, each layer recomputed in the backward: the least memory;
            ``"zero_bubble"``: 1F1B with each backward's weight-gradient half deferred, none a placeholder
            (bubble ``2(S-1)/(3M + 2(S-1))``; S more micro-batches of output cotangents kept).
        repeats: rounds of a circular schedule (1 for gpipe, 1f1b and zero_bubble).
        layers: regex (``re.fullmatch``) naming the ModuleList to pipeline, if the model has several.

    Raises:
        ArgumentError: an argument of the wrong type or value (all listed).

    Examples:
        >>> Pipeline(microbatches=8)
        Pipeline(axis='stage', microbatches=8, schedule='gpipe', repeats=1, layers=None)
        >>> Pipeline(microbatches=8, schedule="circular", repeats=2).bubble(stages=4)
        0.15789473684210525
    """

    axis: str = "stage"
    microbatches: int | None = None
    schedule: str = "gpipe"
    repeats: int = 1
    _: dataclasses.KW_ONLY
    layers: str | None = None

    def __post_init__(self) -> None:
        problems = [] if isinstance(self.axis, str) else [f"axis={self.axis!r} must be a mesh axis name"]
        problems += int_problems("microbatches", self.microbatches, minimum=1, none="one per stage")
        problems += int_problems("repeats", self.repeats, minimum=1)
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule={self.schedule!r} must be one of {list(SCHEDULES)}")
        elif self.schedule != "circular" and self.repeats != 1:
            problems.append(f"repeats={self.repeats!r} needs schedule='circular' ({self.schedule} makes one pass)")
        if self.layers is not None and (problem := regex_problem(self.layers)) is not None:
            problems.append(f"layers={self.layers!r} {problem}; name the ModuleList to pipeline, or pass None")
        raise_for_arguments(problems, header="invalid Pipeline arguments")

    def bubble(self, *, stages: int) -> float:
        """The idle fraction of the schedule on ``stages`` stages (`bubble_fraction`)."""
        return bubble_fraction(stages, self.microbatches or stages, self.repeats, schedule=self.schedule)


@dataclasses.dataclass(frozen=True)
class Stages:
    """A `Pipeline` resolved against a mesh and a stack of ``layers`` layers: what the step runs."""

    mesh: Mesh
    axis: str
    stages: int
    microbatches: int
    repeats: int
    layers: int
    batch: Any = None  # the mesh axes a micro-batch's rows are sharded over (a PartitionSpec entry)
    schedule: str = "gpipe"

    @property
    def chunk(self) -> int:
        """Layers per chunk (a stage holds ``repeats`` chunks)."""
        return self.layers // (self.stages * self.repeats)

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.microbatches, self.repeats, schedule=self.schedule)

    def order(self) -> tuple[int, ...]:
        """Storage position → layer index: stage ``s``'s ``repeats`` chunks are contiguous, chunk ``j`` on ``j mod S``.

        Examples:
            >>> mesh = jax.sharding.AbstractMesh((2,), ("stage",))
            >>> Stages(mesh, "stage", stages=2, microbatches=2, repeats=2, layers=8).order()
            (0, 1, 4, 5, 2, 3, 6, 7)
        """
        s, r, c = self.stages, self.repeats, self.chunk
        return tuple((k * s + stage) * c + i for stage in range(s) for k in range(r) for i in range(c))

    def stage_of(self, layer: int) -> int:
        """The stage whose devices hold ``layer``."""
        return (layer // self.chunk) % self.stages


def resolve(pipeline: Pipeline, mesh: Mesh, *, prefix: str, layers: int, batch: Any = None) -> Stages:
    """``pipeline`` on ``mesh`` for the ``layers`` layers of the ModuleList ``prefix``.

    Raises:
        ShardingError: the mesh has no such axis, the layers do not split into ``S * repeats`` equal
            chunks, or there are fewer micro-batches than stages (each with the sizes that work).
    """
    if pipeline.axis not in mesh.shape:
        raise ShardingError(
            f"Pipeline(axis={pipeline.axis!r}): {describe_mesh(mesh)} has no axis {pipeline.axis!r}; add one, "
            f"e.g. make_mesh({{{pipeline.axis!r}: 2, ...}}), or name one of {list(mesh.shape)}"
        )
    stages, repeats = mesh.shape[pipeline.axis], pipeline.repeats
    microbatches = pipeline.microbatches or stages
    where = f"Pipeline over {pipeline.axis} (size {stages}) on {describe_mesh(mesh)}"
    problems = []
    if layers % (stages * repeats):
        fits = [n for n in range(1, layers + 1) if layers % n == 0]
        problems.append(
            f"{prefix} has {layers} layers, not divisible into {pipeline.axis} ({stages}) × repeats ({repeats}) = "
            f"{stages * repeats} chunks; use a layer count that is a multiple of {stages * repeats}, or stages × "
            f"repeats that divides {layers}: one of {fits}"
        )
    if microbatches < stages:
        problems.append(
            f"microbatches={microbatches} is fewer than the {stages} stages: use microbatches ≥ {stages} (every "
            f"stage needs a micro-batch of its own)"
        )
    if problems:
        raise ShardingError(problems, header=f"{where} cannot split this model ({len(problems)} problem(s))")
    return Stages(mesh, pipeline.axis, stages, microbatches, repeats, layers, batch, pipeline.schedule)


def _split(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] → [M, B/M, ...] taking rows i, i+M, ...: each data shard keeps its own rows."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _merge(x: jax.Array) -> jax.Array:
    """The inverse of `_split`."""
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
        if _by_batch(x, rows) and not isinstance(x, jax.core.Tracer) and not jnp.issubdtype(x.dtype, jnp.floating):
            with jax.ensure_compile_time_eval():  # evaluated now, on the constant: the result stays one
                first = x[:1]
                x = first if bool((x == first).all()) else x
        out.append(x)
    return out


def _by_batch(x: jax.Array, rows: int) -> bool:
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
    shards: int = 1  # the weights' copies over the batch axes (`_gathered`): each runs its own rows of a micro-batch

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

    def layers(self, weights: Mapping[str, jax.Array], h: jax.Array, keys: jax.Array, repeat: jax.Array,
               micro: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        """Layer ``i`` of every stage's chunk (of its ``repeat``) on its micro-batch, each stage on its own devices."""
        split = tuple(_per_stage(x, micro) for x in self.split)
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
            h, after = jax.vmap(one, spmd_axis_name=_batch_axes(self.spec))(layer, h, split, keys)
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
        h = self.constrain(jnp.where(_column((i == 0) & (stage == 0), h.ndim), first, h), spec.batch)
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


def _column(mask: jax.Array, ndim: int) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (ndim - 1))


def _per_stage(x: jax.Array, index: jax.Array) -> jax.Array:
    """Stage s's slice ``x[index[s]]`` (``[S, ...]``): local on each stage's devices."""
    return jax.vmap(lambda i: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False))(index)


def _unsliced(prim: Any, *_: Any, **__: Any) -> bool:
    # a layer's slice of the stack is not kept for the backward, which slices the stack again: kept, it would be a
    # copy of the stack (autodiff stacks a loop-invariant residual outside the loop)
    return prim not in (jax.lax.dynamic_slice_p, jax.lax.gather_p)


def backward_policy(schedule: str, policy: Any) -> Any:
    """What the backward keeps of each layer: ``policy`` (remat) or everything, never a slice of the stack;
    only the layer's input for circular and 1f1b_remat, which recompute the layer in the backward."""
    if schedule in ("circular", "1f1b_remat"):
        return jax.checkpoint_policies.nothing_saveable
    if policy is None:
        return _unsliced
    return lambda prim, *args, **params: _unsliced(prim) and policy(prim, *args, **params)


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
    weights = {k: jax.lax.with_sharding_constraint(w.reshape(*blocks, *w.shape[1:]), _stage_spec(spec, w.ndim, blocks))
               for k, w in params.items()}  # fmt: skip
    others = narrowed(others, rows)
    split = tuple(_split(x, m) for x in others if _by_batch(x, rows))
    whole = tuple(x for x in others if not _by_batch(x, rows))
    loop = _Loop(spec, _reordered(layer_fn, others, rows), weights, split, whole, key,
                 backward_policy(spec.schedule, policy))  # fmt: skip
    shards = _shards(spec, rows // m)
    try:
        try:
            buffer = _looped(loop, _split(h, m), shards, len(blocks))
        except ValueError as err:
            if shards == 1 or "spmd_axis_name cannot appear in shard_map" not in str(err):
                raise
            # a shard_map inside the layers splits the rows over the batch axes itself (expert dispatch's
            # all-to-all): the loop cannot split them too, and keeps the weights sharded (traffic per iteration)
            buffer = _looped(loop, _split(h, m), 1, len(blocks))
    except (TypeError, ValueError) as err:
        if isinstance(err, ShardingError) or not (whole_rows := _whole_rows(h, others, names)):
            raise
        raise ShardingError(_whole_rows_message(err, where, h, m, whole_rows)) from err
    return _merge(buffer[0]), jax.random.fold_in(key, spec.iterations)


def _looped(loop: _Loop, micro: jax.Array, shards: int, lead: int) -> jax.Array:
    """The loop over every iteration's layers, with ``shards`` copies of the weights (`_gathered`): the buffer."""
    spec = loop.spec
    loop = dataclasses.replace(loop, weights=_gathered(spec, dict(loop.weights), shards, lead), shards=shards)
    buffer = loop.constrain(jnp.broadcast_to(micro, (spec.stages, *micro.shape)), None, spec.batch)
    shift = loop.constrain(jnp.zeros((spec.stages, *micro.shape[1:]), micro.dtype), spec.batch)
    steps = jnp.arange(spec.iterations * spec.chunk)
    with contextlib.ExitStack() as vmapped:  # shard_maps inside the layers (context-parallel attention) take the
        for axis in (spec.axis, *(_batch_axes(spec) if shards > 1 else ())):  # vmapped axes as manual ones
            vmapped.enter_context(vmapped_over(axis))
        (buffer, _, _), _ = jax.lax.scan(loop.step, (buffer, shift, loop.keys(jnp.int32(0))), steps)
    return buffer


def _whole_rows(h: jax.Array, others: Sequence[jax.Array], names: Sequence[str]) -> list[str]:
    """The rank-1 call arguments as long as the rows, which went whole to every micro-batch: ``name dtype[shape]``."""
    named = [*names, *(f"argument #{i + 1}" for i in range(len(names), len(others)))]
    return [f"{n} ({x.dtype}{list(x.shape)})" for n, x in zip(named, others, strict=False)
            if x.ndim == 1 and not _by_batch(x, h.shape[0]) and x.shape[0] == h.shape[0]]  # fmt: skip


def _whole_rows_message(err: BaseException, where: str, h: jax.Array, m: int, whole: Sequence[str]) -> str:
    rows = h.shape[0]
    first = (str(err).strip().splitlines() or [""])[0]
    return (
        f"{where}: a layer failed ({type(err).__name__}: {first}) after the pipeline split the hidden state "
        f"{list(h.shape)} along dim 0 into microbatches={m} of {rows // m} rows and gave {', '.join(whole)} whole "
        f"to every micro-batch: a rank-1 argument is taken as per-position (like cache_position), not per-row. "
        f"If the rows are independent samples, give it a trailing dim (x[:, None], shape [{rows}, 1]) so it is "
        f"split with them. If they are one flat token stream (tokens [T] with positions [T]), a micro-batch would "
        f"cut the sequence and tokens could attend only within it: feed rows of sequences instead, tokens [B, S] "
        f"with positions [B, S], which split whole sequences"
    )


def _batch_axes(spec: Stages) -> tuple[str, ...]:
    """The mesh axes a micro-batch's rows are sharded over, as a tuple."""
    return () if spec.batch is None else (spec.batch,) if isinstance(spec.batch, str) else tuple(spec.batch)


def _shards(spec: Stages, rows: int) -> int:
    """Copies of the stage's weights: one per shard of the batch axes if a micro-batch's ``rows`` split over them."""
    d = math.prod(spec.mesh.shape[axis] for axis in _batch_axes(spec))
    return d if d > 1 and rows % d == 0 else 1


def _gathered(spec: Stages, weights: dict[str, jax.Array], shards: int, lead: int) -> dict[str, jax.Array]:
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
        dims = [spec.axis, _batch_axes(spec), *[None] * (lead - 1), *[PartitionSpec.UNCONSTRAINED] * (w.ndim - lead)]
        out[k] = jax.lax.with_sharding_constraint(copies, NamedSharding(spec.mesh, PartitionSpec(*dims)))
    return out


def _stage_spec(spec: Stages, ndim: int, blocks: tuple[int, ...]) -> NamedSharding:
    # the layer's own dims keep the plan's sharding over the other axes
    rest = [PartitionSpec.UNCONSTRAINED] * (ndim - 1)
    return NamedSharding(spec.mesh, PartitionSpec(spec.axis, *[None] * (len(blocks) - 1), *rest))


def _reordered(layer_fn: LayerFn, others: Sequence[jax.Array], rows: int) -> LayerFn:
    """``layer_fn`` taking (split..., whole...) call arrays back in the order the layer was called with."""
    by_batch = [_by_batch(x, rows) for x in others]

    def call(layer, h, grouped, key):
        split, whole = iter(grouped[: sum(by_batch)]), iter(grouped[sum(by_batch) :])
        return layer_fn(layer, h, [next(split) if b else next(whole) for b in by_batch], key)

    return call
