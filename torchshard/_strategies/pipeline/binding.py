"""The pipeline strategy: which ModuleList a `Pipeline` splits, checked against the model, plan and batch spec;
how the step runs it (its stages, by `pipeline.run`); its ``plan --compile --pipeline`` and ``--search`` options."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._base.specs import spec_axes
from torchshard._base.validate import compiled, describe_mesh, instance_problems, raise_for_arguments
from torchshard._bridge.env import current_key
from torchshard._bridge.module_call import PureForward, argument_names
from torchshard._sharding.plan import PlanColumn, ShardingPlan
from torchshard._strategies.pipeline import grads as one_f_one_b_grads
from torchshard._strategies.pipeline import loop as schedule
from torchshard._strategies.pipeline.flag import FLAG
from torchshard._strategies.pipeline.option import Pipeline
from torchshard._strategies.pipeline.schedules import SCHEDULES
from torchshard._strategies.pipeline.search import AXIS, OPTIONS, searched
from torchshard._strategies.pipeline.stages import Stages, resolve
from torchshard._train.scan import ScanGroup, ScanRun, block_problems, check_output, find_groups, is_stack, module_lists
from torchshard._train.strategy import Bound, Setting, Strategy


def _all_lists(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if is_stack(m) and n]


def _named(model: torch.nn.Module, pattern: str) -> ScanGroup:
    regex = compiled(pattern)  # Pipeline() checked it
    lists = [n for n, m in model.named_modules() if is_stack(m) and regex.fullmatch(n)]
    if len(lists) != 1:
        found = f"matches {lists}" if lists else "matches no ModuleList"
        raise ShardingError(
            f"Pipeline(layers={pattern!r}) {found} of {type(model).__name__}; name exactly one of its ModuleLists: "
            f"{_all_lists(model)}"
        )
    return find_groups(model, lists[0])[0]


def _found(model: torch.nn.Module, scanned: tuple[ScanGroup, ...]) -> ScanGroup:
    candidates = list(scanned)
    if not candidates:  # no scan_layers: any list of identical blocks, quietly (scan_layers=True warns of the rest)
        candidates = [find_groups(model, n)[0] for n in module_lists(model) if not block_problems(model, n)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        reasons = "; ".join(f"{n}: {block_problems(model, n)[0]}" for n in module_lists(model))
        raise ShardingError(
            f"Pipeline found no stack of identical layers in {type(model).__name__} (a torch.nn.ModuleList of "
            f"blocks of one type, shapes and settings, called in turn)"
            + (f": {reasons}" if reasons else "")
            + "; a pipeline splits such a stack into stages"
        )
    raise ShardingError(
        f"Pipeline: {type(model).__name__} has several stacks of identical layers {[g.prefix for g in candidates]}; "
        f"name the one to pipeline with Pipeline(layers=...)"
    )


def _axis_problems(stages: Stages, group: ScanGroup, plan: ShardingPlan, batch_spec: PartitionSpec) -> list[str]:
    axis = stages.axis
    problems = [
        f"{name} spec {plan.spec(name)}: the plan shards a pipelined layer over the stage axis {axis!r}, which "
        f"holds the layers' stages; shard it over the other axes only"
        for name in (group.name(0, s) for s in group.suffixes)
        if axis in spec_axes(plan.spec(name))
    ]
    if axis in spec_axes(batch_spec):
        problems.append(
            f"batch_spec {batch_spec} shards the batch over the stage axis {axis!r}; every stage needs every "
            f"micro-batch in turn: shard the batch over the other axes, e.g. batch_spec=('data',)"
        )
    return problems


@dataclasses.dataclass(frozen=True)
class Staged:
    """The pipeline's `StackRunner`: the stack stored stage by stage, run by the pipeline schedule."""

    stages: Stages

    @property
    def axis(self) -> str:
        return self.stages.axis

    def order(self) -> tuple[int, ...]:
        return self.stages.order()

    def run(self, scan: ScanRun, pure: PureForward, h: jax.Array, others: Sequence[jax.Array]) -> tuple[Any, Any]:
        prefix, first = scan.group.prefix, scan.group.block(0)

        def layer_fn(layer: Mapping[str, jax.Array], h: jax.Array, others: Sequence[jax.Array], key: jax.Array):
            out, buffers, key, hooked = pure(layer, [h, *others], key)
            check_output(first, pure, out, h)
            if hooked:
                raise ShardingError(
                    f"Pipeline: {first} has forward hooks that collect its submodules' outputs (e.g. MoE router "
                    f"logits for an auxiliary loss), which a pipeline cannot carry out of its stages; turn them off "
                    f"(output_router_logits=False) or leave {prefix} unpipelined"
                )
            changed = sorted(name for name, array in buffers.items() if array is not layer[name])
            if changed:
                raise ShardingError(
                    f"Pipeline: {first} updates its buffer(s) {changed} (e.g. BatchNorm running stats), which "
                    f"pipelined blocks cannot carry between micro-batches; use a norm without running stats, or "
                    f"leave {prefix} unpipelined"
                )
            return out[0], key

        scan.new_buffers = {s: a for s, a in scan.params.items() if s in scan.group.buffers}
        layer = {s: w[0] for s, w in scan.params.items()}
        given = one_f_one_b_grads.intercepted(pure, layer, layer_fn, h, others, current_key(), scan.body_policy)
        if given is not None:
            return given  # a 1F1B step's prefix or tail: the stack runs in its own loop
        where = f"Pipeline: {prefix}"
        return schedule.run(
            self.stages,
            layer_fn,
            scan.params,
            h,
            others,
            current_key(),
            policy=scan.body_policy,
            where=where,
            names=argument_names(scan.forward, pure.inputs)[1:],
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipelined(Bound):
    """A `Pipeline` bound to a model: the stack it splits, resolved into `Stages` on the plan's mesh."""

    option: Pipeline
    group: ScanGroup  # the stack it splits, as scan_layers found it
    stages: Stages

    def rewrite(self, setting: Setting) -> Setting:
        """The stack stored stage by stage (scanned, whether scan_layers named it or not); the plan table says
        which stage holds each layer."""
        staged = dataclasses.replace(self.group, runner=Staged(self.stages))
        rest = tuple(g for g in setting.groups if g.prefix != staged.prefix)
        where = {
            staged.name(block, suffix): self.stages.stage_of(block)
            for suffix in staged.suffixes
            for block in range(staged.count)
        }
        stage_column = PlanColumn("stage", where)  # the stage whose devices alone hold each layer ("all": every one)
        planned = setting.plan.with_groups({name: f"stage {s}" for name, s in where.items()}, stage_column)
        return dataclasses.replace(setting, groups=(*rest, staged), plan=planned)

    def rows(self) -> tuple[str, int]:
        return "microbatches", self.stages.microbatches

    def gradient(self) -> Any:
        """1F1B and zero-bubble differentiate the step themselves: the loss and the backward run in their loop."""
        if SCHEDULES[self.stages.schedule].loop is None:
            return None
        return one_f_one_b_grads.gradient(self.stages, self.group)

    @property
    def idle_fraction(self) -> float:
        return SCHEDULES[self.stages.schedule].bubble(self.stages.stages, self.stages.microbatches, self.stages.repeats)


def bind(pipeline: Any, setting: Setting) -> Bound:
    """``Trainer(pipeline=)``: the stack to pipeline, checked against the model, plan and batch spec.

    Raises:
        ArgumentError: ``pipeline`` is not a `Pipeline`.
        ShardingError: no stack to pipeline, a mesh without the axis, sizes that do not split
            (with the ones that do), or a plan or batch spec that uses the stage axis.
    """
    if pipeline is None:
        return Bound()
    raise_for_arguments(
        instance_problems("pipeline", pipeline, Pipeline, "None or a torchshard.Pipeline"),
        header="invalid Trainer arguments",
    )
    mesh, batch_spec = setting.plan.mesh, setting.batch_spec
    assert isinstance(mesh, Mesh)  # checked with the other Trainer arguments
    model = setting.model
    group = _named(model, pipeline.layers) if pipeline.layers is not None else _found(model, setting.groups)
    batch = batch_spec[0] if len(batch_spec) else None
    remats = SCHEDULES[pipeline.schedule].remats_each_layer
    stages = resolve(pipeline, mesh, prefix=group.prefix, layers=group.count, batch=batch, remats_each_layer=remats)
    problems = _axis_problems(stages, group, setting.plan, batch_spec)
    raise_if_any(problems, header=f"Pipeline over {stages.axis} on {describe_mesh(mesh)} cannot use this plan")
    return Pipelined(option=pipeline, group=group, stages=stages)


STRATEGY = Strategy(
    keyword="pipeline",
    option=Pipeline,
    bind=bind,
    lays_out=True,
    flag=FLAG,
    searched=searched,
    axis=AXIS,
    search_options=OPTIONS,
)
