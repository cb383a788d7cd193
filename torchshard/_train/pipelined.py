"""A Trainer's `Pipeline`: which ModuleList it splits, checked against the model, plan and batch spec."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._base.specs import spec_axes
from torchshard._base.validate import compiled, describe_mesh, raise_for_arguments
from torchshard._parallel.pipeline import Pipeline, Stages, resolve
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.scan import ScanGroup, block_problems, find_groups, is_stack, module_lists


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


def pipeline_groups(
    model: torch.nn.Module,
    plan: ShardingPlan,
    groups: tuple[ScanGroup, ...],
    pipeline: Any,
    batch_spec: PartitionSpec,
) -> tuple[tuple[ScanGroup, ...], dict[str, Stages]]:
    """The scanned groups with the pipelined one stored stage by stage, and its resolved `Stages` by prefix.

    Raises:
        ArgumentError: ``pipeline`` is not a `Pipeline`.
        ShardingError: no stack to pipeline, a mesh without the axis, sizes that do not split
            (with the ones that do), or a plan or batch spec that uses the stage axis.
    """
    if pipeline is None:
        return groups, {}
    if not isinstance(pipeline, Pipeline):
        raise_for_arguments(
            [f"pipeline must be None or a torchshard.Pipeline, got {type(pipeline).__name__}"],
            header="invalid Trainer arguments",
        )
    mesh = plan.mesh
    assert isinstance(mesh, Mesh)  # checked with the other Trainer arguments
    group = _named(model, pipeline.layers) if pipeline.layers is not None else _found(model, groups)
    batch = batch_spec[0] if len(batch_spec) else None
    stages = resolve(pipeline, mesh, prefix=group.prefix, layers=group.count, batch=batch)
    problems = _axis_problems(stages, group, plan, batch_spec)
    raise_if_any(problems, header=f"Pipeline over {stages.axis} on {describe_mesh(mesh)} cannot use this plan")
    staged = dataclasses.replace(group, order=stages.order(), axis=stages.axis)
    rest = tuple(g for g in groups if g.prefix != group.prefix)
    return (*rest, staged), {group.prefix: stages}


def stage_map(groups: tuple[ScanGroup, ...], stages: dict[str, Stages]) -> dict[str, int]:
    """torch name → the stage holding it, for every tensor of a pipelined stack (for the plan table)."""
    return {
        group.name(block, suffix): stages[group.prefix].stage_of(block)
        for group in groups
        if group.prefix in stages
        for suffix in group.suffixes
        for block in range(group.count)
    }


def batch_factor(grad_accum_steps: int, stages: dict[str, Stages]) -> tuple[str, int]:
    """What a batch's rows must split into: grad_accum_steps micro-batches, each into a pipeline's micro-batches."""
    micro = max((s.microbatches for s in stages.values()), default=1)
    if micro == 1:
        return "grad_accum_steps", grad_accum_steps
    if grad_accum_steps == 1:
        return "microbatches", micro
    return "grad_accum_steps × microbatches", grad_accum_steps * micro
