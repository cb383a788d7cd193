"""Pipeline parallelism: a stack of identical layers split into stages over a mesh axis, micro-batches streamed through.

The layers' weights are stacked ``[L, ...]`` with the stage axis on the layer dim, stored so that
a contiguous split gives each stage its chunks. One loop of ``repeats·M + S - 1`` iterations runs
every stage on its current micro-batch at once (``vmap`` over the stage dim: under GSPMD each
device computes only its own stage), then passes every stage's output to the next stage with a
``ppermute`` (a collective-permute). Autodiff of the loop is the backward pass; under ``"1f1b"`` each
iteration's stage work is checkpointed whole, so the backward recomputes and differentiates one
micro-batch per stage at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError
from torchshard._base.validate import describe_mesh, int_problems, raise_for_arguments, regex_problem
from torchshard._parallel.vmapped import vmapped_over

SCHEDULES = ("gpipe", "circular", "1f1b")
LAYER_INPUT = "torchshard_pipeline_layer_input"  # the activations a circular schedule keeps for the backward
# layer_fn(one layer's arrays, hidden state, other call arrays, key) -> (hidden state, key after)
LayerFn = Callable[[Mapping[str, jax.Array], jax.Array, Sequence[jax.Array], jax.Array], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism over a model's stack of identical layers, for ``Trainer(..., pipeline=...)``.

    The stack (the ModuleList ``scan_layers=True`` finds, or the one ``layers`` names) is split into
    ``S * repeats`` contiguous chunks of layers, ``S = mesh.shape[axis]``; a chunk's weights live only
    on the devices at its index of ``axis`` (sharded over the other axes as the plan says). Each batch
    is split into ``microbatches`` along dim 0 and streamed through the stages; activations move
    between stages with ``ppermute``. Everything outside the stack (embeddings, final norm, head,
    loss) runs outside the pipeline.

    Args:
        axis: the mesh axis the stages are laid along.
        microbatches: micro-batches per batch (at least the number of stages; default: one per stage).
        schedule: ``"gpipe"``: all forwards, then the backward by autodiff; ``"circular"``: chunk ``j``
            on stage ``j mod S``, and micro-batches go ``repeats`` times round the stages, which shrinks
            the idle fraction to ``(S-1)/(repeats*M + S-1)``; ``"1f1b"``: gpipe's order, but the forward
            keeps only each stage's input per micro-batch and the backward runs one micro-batch's
            stage forward and its backward together, so a stage holds one micro-batch's activations
            (at most S in the pipe) instead of M, for one more stage forward per micro-batch.
        repeats: rounds of a circular schedule (1 for gpipe and 1f1b).
        layers: regex (``re.fullmatch``) naming the ModuleList to pipeline, if the model has several.

    Raises:
        ArgumentError: an argument of the wrong type or value (all listed).

    Example:
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
        """The idle fraction of the schedule on ``stages`` stages: ``(S-1)/(repeats*M + S-1)``."""
        microbatches = self.microbatches or stages
        return (stages - 1) / (self.repeats * microbatches + stages - 1)


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
        return (self.stages - 1) / self.iterations

    def order(self) -> tuple[int, ...]:
        """Storage position → layer index: stage ``s``'s ``repeats`` chunks are contiguous, chunk ``j`` on ``j mod S``.

        Example:
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


def _by_batch(x: jax.Array, rows: int) -> bool:
    # a call argument of rank ≥ 2 whose leading dim is the batch's (a mask, positions) is split with the rows;
    # rank-1 arguments (cache positions) and broadcast ones (leading dim 1) go to every micro-batch whole
    return x.ndim >= 2 and x.shape[0] == rows and rows > 1


@dataclasses.dataclass(frozen=True)
class _Loop:
    """The arrays and functions of one pipelined call, shared by every iteration."""

    spec: Stages
    stage_fn: Callable[..., tuple[jax.Array, jax.Array]]
    weights: Mapping[str, jax.Array]  # [S, repeats, chunk, ...], or [S, chunk, ...] for one repeat
    split: tuple[jax.Array, ...]  # batch-split call arguments, [M, mb, ...]
    whole: tuple[jax.Array, ...]
    key: jax.Array

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

    def stages_out(self, repeat: jax.Array, inputs: jax.Array, micro: jax.Array, keys: jax.Array) -> jax.Array:
        """Every stage's output for this iteration, each stage on its own devices."""
        run = jax.vmap(self.stage_fn, in_axes=(0, 0, 0, None, 0), spmd_axis_name=self.spec.axis)
        repeats = self.spec.repeats

        def compute(weights, repeat, inputs, micro, keys):
            split = tuple(_per_stage(x, micro, shared=True) for x in self.split)
            chunk = weights if repeats == 1 else {k: _per_stage(w, repeat) for k, w in weights.items()}
            return run(chunk, inputs, split, self.whole, keys)[0]

        if self.spec.schedule == "1f1b":
            # keep only each stage's input per micro-batch: the backward recomputes one micro-batch's stage forward
            # at a time and takes its vjp at once, so a stage holds one micro-batch's activations, never M of them
            compute = jax.checkpoint(compute, policy=jax.checkpoint_policies.nothing_saveable)
        elif repeats > 1:
            # each stage's chunk changes with its repeat: autodiff would keep every iteration's slice of the weights
            # for the backward; instead keep only each layer's input and recompute the rest (as remat would)
            compute = jax.checkpoint(compute, policy=jax.checkpoint_policies.save_only_these_names(LAYER_INPUT))
        return compute(self.weights, repeat, inputs, micro, keys)

    def iteration(self, carry: tuple[jax.Array, jax.Array], t: jax.Array):
        buffer, shift = carry
        spec, stage = self.spec, jnp.arange(self.spec.stages)
        m, s = spec.microbatches, spec.stages
        first = jax.lax.dynamic_index_in_dim(buffer, t % m, 1, keepdims=False)
        inputs = jnp.where(_column(stage == 0, shift.ndim), first, shift)
        inputs = self.constrain(inputs, spec.batch)
        # stage s runs micro-batch (t - s) mod M of repeat (t - s) // M; outside 0..repeats-1 it idles on junk
        ahead = t - stage
        repeat = jnp.clip(ahead // m, 0, spec.repeats - 1)
        micro = ahead % m
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(self.key, t), i))(stage)
        out = self.stages_out(repeat, inputs, micro, keys)
        rotated = self.constrain(self.rotate(out), spec.batch)
        # stage 0's slot now holds the last stage's output: micro-batch t-S+1 is done with this round
        done = (t - s + 1) % m
        old = jax.lax.dynamic_index_in_dim(buffer, done, 1, keepdims=False)
        kept = jnp.where(t >= s - 1, rotated, old)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, kept, done, 1)
        return (buffer, rotated), None


def _column(mask: jax.Array, ndim: int) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (ndim - 1))


def _per_stage(x: jax.Array, index: jax.Array, *, shared: bool = False) -> jax.Array:
    """Stage s's slice ``index[s]`` of its own ``x[s]`` (or of a ``shared`` x): local on each stage's devices."""
    take = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)  # noqa: E731
    if shared:
        return jax.vmap(take, in_axes=(None, 0))(x, index)
    return jax.vmap(take)(x, index)


def stage_function(layer_fn: LayerFn, policy: Any) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """One stage's work: its chunk's layers in turn (a ``lax.scan``), each under ``policy`` if given."""

    def stage(weights, h, split, whole, key):
        others = (*split, *whole)

        def body(carry, layer):
            h, key = carry
            return layer_fn(layer, checkpoint_name(h, LAYER_INPUT), others, key), None

        step = jax.checkpoint(body, policy=policy) if policy is not None else body
        return jax.lax.scan(step, (h, key), dict(weights))[0]

    return stage


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
    split = tuple(_split(x, m) for x in others if _by_batch(x, rows))
    whole = tuple(x for x in others if not _by_batch(x, rows))
    loop = _Loop(spec, stage_function(_reordered(layer_fn, others, rows), policy), weights, split, whole, key)
    micro = _split(h, m)
    buffer = loop.constrain(jnp.broadcast_to(micro, (spec.stages, *micro.shape)), None, spec.batch)
    shift = loop.constrain(jnp.zeros((spec.stages, *micro.shape[1:]), h.dtype), spec.batch)
    try:
        with vmapped_over(spec.axis):  # shard_maps inside the layers (context-parallel attention) take the axis
            (buffer, _), _ = jax.lax.scan(loop.iteration, (buffer, shift), jnp.arange(spec.iterations))
    except (TypeError, ValueError) as err:
        if isinstance(err, ShardingError) or not (whole_rows := _whole_rows(h, others, names)):
            raise
        raise ShardingError(_whole_rows_message(err, where, h, m, whole_rows)) from err
    return _merge(buffer[0]), jax.random.fold_in(key, spec.iterations)


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
