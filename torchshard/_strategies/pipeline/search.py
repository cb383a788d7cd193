"""What ``plan --search`` needs of a pipeline: its stage axis, the micro-batches and schedules it tries
(``--microbatches``, ``--schedules``), its bubble and its hops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchshard._strategies.pipeline.option import Pipeline
from torchshard._strategies.pipeline.schedule import DEFAULT_SCHEDULE
from torchshard._strategies.pipeline.schedules import SCHEDULES
from torchshard._train.search_seam import GRAD_ACCUM, SearchAxis, SearchedLayout, SearchOption

AXIS_NAME = "stage"
MICROBATCHES, SCHEDULE = "microbatches", "schedule"  # the layout options the pipeline's search choices set
TRIED_COUNTS = (1, 2, 4)  # --microbatches' default


def searched(layout: SearchedLayout) -> Pipeline | None:
    """A candidate's `Pipeline`: on a mesh with stages, its micro-batches and schedule."""
    if layout.axes.get(AXIS_NAME, 1) == 1:
        return None
    schedule = layout.option(SCHEDULE, DEFAULT_SCHEDULE)
    return Pipeline(axis=AXIS_NAME, microbatches=layout.option(MICROBATCHES, 1), schedule=schedule)


def _fits(dims: Any, seq: int, degree: int) -> bool:
    return degree == 1 or (dims.layers is not None and dims.layers % degree == 0)


def _per_stage(axes: dict[str, int], count: int) -> dict[str, int]:
    # --microbatches counts micro-batches per stage (every stage needs its own); off a pipeline, accumulation steps
    stages = axes.get(AXIS_NAME, 1)
    return {MICROBATCHES: count * stages} if stages > 1 else {GRAD_ACCUM: count}


def _scheduled(axes: dict[str, int], schedule: str) -> dict[str, str]:
    return {SCHEDULE: schedule} if axes.get(AXIS_NAME, 1) > 1 else {}


def _tried() -> tuple[str, ...]:
    return tuple(name for name, s in SCHEDULES.items() if s.searched)


def _allowed() -> tuple[str, ...]:
    return tuple(name for name, s in SCHEDULES.items() if s.searchable)


def _microbatches(layout: Any) -> int:
    return layout.option(MICROBATCHES, 1) if layout.degree(AXIS_NAME) > 1 else 1


def _not_leanest(layout: Any, tried: Sequence[str]) -> bool:
    """Whether ``layout``'s schedule holds more micro-batches' activations than the leanest ``tried`` one (a mesh is
    compiled first with the schedule that fits most: ``"1f1b"`` holds at most 2S-1, gpipe M+S-1)."""
    schedule = layout.option(SCHEDULE)
    if schedule is None or not tried:
        return False
    stages, microbatches = layout.degree(AXIS_NAME), _microbatches(layout)
    return schedule != min((SCHEDULES[s].in_flight(stages, microbatches), s) for s in tried)[1]


def _idle(layout: Any) -> float:
    stages = layout.degree(AXIS_NAME)
    schedule = SCHEDULES[layout.option(SCHEDULE) or DEFAULT_SCHEDULE]
    return schedule.bubble(stages, layout.option(MICROBATCHES, 1), 1) if stages > 1 else 0.0


def _hops(layout: Any, dims: Any, activation_bytes: float, layers: float) -> float:
    # each micro-batch's activations cross every stage boundary forward and back
    return 2 * activation_bytes * (dims.hidden or 0) if layout.degree(AXIS_NAME) > 1 else 0.0


def _recomputes(layout: Any) -> bool:
    schedule = layout.option(SCHEDULE)
    return schedule is not None and SCHEDULES[schedule].remats_each_layer


def _label(layout: Any) -> str:
    if layout.degree(AXIS_NAME) == 1:
        return ""
    schedule = layout.option(SCHEDULE)
    return f" pipeline M={layout.option(MICROBATCHES, 1)}" + (f" {schedule}" if schedule else "")


AXIS = SearchAxis(
    name=AXIS_NAME,
    fits=_fits,
    outer=True,
    splits_weights=True,
    splits_layers=True,
    needs_scan=True,
    rows=_microbatches,
    recomputes=_recomputes,
    idle=_idle,
    traffic=_hops,
    label=_label,
)
OPTIONS = (
    SearchOption(
        name="microbatches",
        help="grad accumulation / micro-batches per stage (>= 1) to try",
        tried=lambda: TRIED_COUNTS,
        keys=(MICROBATCHES, GRAD_ACCUM),
        sets=_per_stage,
    ),
    SearchOption(
        name="schedules",
        help="pipeline schedules to try on stage meshes",
        tried=_tried,
        allowed=_allowed,
        keys=(SCHEDULE,),
        sets=_scheduled,
        prefer=_not_leanest,
    ),
)
