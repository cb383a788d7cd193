"""What ``plan --search`` needs of a pipeline: its stage axis, the schedules to try, its bubble and its hops."""

from __future__ import annotations

from typing import Any

from torchshard._strategies.pipeline.option import Pipeline
from torchshard._strategies.pipeline.schedules import SCHEDULES
from torchshard._train.strategy import SearchAxis, SearchedLayout

AXIS_NAME = "stage"


def searched(layout: SearchedLayout) -> Pipeline | None:
    """A candidate's `Pipeline`: on a mesh with stages, its micro-batches and schedule."""
    if layout.axes.get(AXIS_NAME, 1) == 1:
        return None
    return Pipeline(axis=AXIS_NAME, microbatches=layout.microbatches, schedule=layout.schedule or "gpipe")


def _fits(dims: Any, seq: int, degree: int) -> bool:
    return degree == 1 or (dims.layers is not None and dims.layers % degree == 0)


def _variants() -> tuple[tuple[str, ...], tuple[str, ...]]:
    tried = tuple(name for name, s in SCHEDULES.items() if s.searched)
    return tried, tuple(name for name, s in SCHEDULES.items() if s.searchable)


def _holds(schedule: str, stages: int, microbatches: int) -> int:
    return SCHEDULES[schedule].in_flight(stages, microbatches)


def _idle(layout: Any) -> float:
    stages = layout.degree(AXIS_NAME)
    return SCHEDULES[layout.schedule or "gpipe"].bubble(stages, layout.microbatches, 1) if stages > 1 else 0.0


def _hops(layout: Any, dims: Any, activation_bytes: float, layers: float) -> float:
    # each micro-batch's activations cross every stage boundary forward and back
    return 2 * activation_bytes * (dims.hidden or 0) if layout.degree(AXIS_NAME) > 1 else 0.0


def _recomputes(schedule: str) -> bool:
    return SCHEDULES[schedule].remats_each_layer


AXIS = SearchAxis(
    name=AXIS_NAME,
    fits=_fits,
    outer=True,
    splits_weights=True,
    microbatches=True,
    needs_scan=True,
    variants=_variants,
    holds=_holds,
    recomputes=_recomputes,
    idle=_idle,
    traffic=_hops,
)
