"""A `Pipeline` resolved against a mesh and a stack of layers: the stages the loops run."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from torchshard._base.errors import ShardingError
from torchshard._base.validate import describe_mesh
from torchshard._strategies.pipeline.schedule import DEFAULT_SCHEDULE


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
    schedule: str = DEFAULT_SCHEDULE
    remats_each_layer: bool = False  # the schedule's backward recomputes each layer (`Schedule.remats_each_layer`)

    @property
    def chunk(self) -> int:
        """Layers per chunk (a stage holds ``repeats`` chunks)."""
        return self.layers // (self.stages * self.repeats)

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

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


def resolve(
    pipeline: Any, mesh: Mesh, *, prefix: str, layers: int, batch: Any = None, remats_each_layer: bool = False
) -> Stages:
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
    return Stages(
        mesh, pipeline.axis, stages, microbatches, repeats, layers, batch, pipeline.schedule, remats_each_layer
    )
