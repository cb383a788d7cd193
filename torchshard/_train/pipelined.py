"""The pipeline strategy: which ModuleList a `Pipeline` splits, checked against the model, plan and batch spec."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._base.specs import spec_axes
from torchshard._base.validate import compiled, describe_mesh, instance_problems, raise_for_arguments
from torchshard._parallel.pipeline import Pipeline, Stages, resolve
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.scan import ScanGroup, block_problems, find_groups, is_stack, module_lists
from torchshard._train.strategy import Bound, Setting


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
            f"blocks of one type, shapes and settings, called in turn)" + (f": {reasons}" if reasons else "")
            + "; a pipeline splits such a stack into stages"
        )  # fmt: skip
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipelined(Bound):
    """A `Pipeline` bound to a model: the stack it splits, resolved into `Stages` on the plan's mesh."""

    option: Pipeline
    group: ScanGroup  # the stack it splits, as scan_layers found it
    stages: Stages

    def rewrite(self, setting: Setting) -> Setting:
        """The stack stored stage by stage (scanned, whether scan_layers named it or not); the plan table says
        which stage holds each layer."""
        staged = dataclasses.replace(self.group, stages=self.stages)
        rest = tuple(g for g in setting.groups if g.prefix != staged.prefix)
        where = {staged.name(block, suffix): self.stages.stage_of(block)
                 for suffix in staged.suffixes for block in range(staged.count)}  # fmt: skip
        return dataclasses.replace(setting, groups=(*rest, staged), plan=setting.plan.with_stages(where))

    def rows(self) -> tuple[str, int]:
        return "microbatches", self.stages.microbatches

    @property
    def bubble(self) -> float:
        return self.stages.bubble


def bind(pipeline: Any, setting: Setting) -> Bound:
    """``Trainer(pipeline=)``: the stack to pipeline, checked against the model, plan and batch spec.

    Raises:
        ArgumentError: ``pipeline`` is not a `Pipeline`.
        ShardingError: no stack to pipeline, a mesh without the axis, sizes that do not split
            (with the ones that do), or a plan or batch spec that uses the stage axis.
    """
    if pipeline is None:
        return Bound()
    raise_for_arguments(instance_problems("pipeline", pipeline, Pipeline, "None or a torchshard.Pipeline"),
                        header="invalid Trainer arguments")  # fmt: skip
    mesh, batch_spec = setting.plan.mesh, setting.batch_spec
    assert isinstance(mesh, Mesh)  # checked with the other Trainer arguments
    model = setting.model
    group = _named(model, pipeline.layers) if pipeline.layers is not None else _found(model, setting.groups)
    batch = batch_spec[0] if len(batch_spec) else None
    stages = resolve(pipeline, mesh, prefix=group.prefix, layers=group.count, batch=batch)
    problems = _axis_problems(stages, group, setting.plan, batch_spec)
    raise_if_any(problems, header=f"Pipeline over {stages.axis} on {describe_mesh(mesh)} cannot use this plan")
    return Pipelined(option=pipeline, group=group, stages=stages)
