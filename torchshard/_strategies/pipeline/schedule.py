"""A pipeline schedule: its loop, its idle fraction, what its backward keeps and holds, whether the search tries it.

Every fact about a schedule lives in its `Schedule` (one file under ``schedules/``), read by the
option's checks, the loops, the Trainer binding and the plan search; none of them names a schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def lockstep_bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle fraction of a loop of ``repeats·M + S - 1`` iterations: ``(S-1)/(repeats*M + S-1)``; 0 for one stage.

    Examples:
        >>> lockstep_bubble(4, 8), lockstep_bubble(1, 8)
        (0.2727272727272727, 0.0)
    """
    return (stages - 1) / (repeats * microbatches + stages - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """One pipeline schedule.

    Attributes:
        name: its ``Pipeline(schedule=)`` name.
        summary: one line for messages and ``--help``.
        bubble: ``(stages, microbatches, repeats) -> idle fraction`` of the devices' time.
        in_flight: ``(stages, microbatches) -> micro-batches`` whose activations a stage holds at once.
        loop: None where the step's autodiff differentiates the stage loop (`loop.run`); else a function
            returning the loop that runs forwards and backwards itself (``ticks.run``'s signature),
            imported when first used.
        remats_each_layer: the backward recomputes each layer from its input (keeps nothing else).
        repeats: takes ``repeats > 1`` (rounds over the stages).
        searched: ``plan --search`` tries it by default; ``searchable``: it may be asked to try it.
    """

    name: str
    summary: str
    bubble: Callable[[int, int, int], float] = lockstep_bubble
    in_flight: Callable[[int, int], int] = lambda stages, microbatches: microbatches + stages - 1
    loop: Callable[[], Callable[..., Any]] | None = None
    remats_each_layer: bool = False
    repeats: bool = False
    searched: bool = False
    searchable: bool = True


SCHEDULES: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    """Adds ``schedule`` under its name (a name taken by another schedule is a `ValueError`)."""
    taken = SCHEDULES.get(schedule.name)
    if taken is not None and taken != schedule:
        raise ValueError(f"pipeline schedule {schedule.name!r} is taken")
    SCHEDULES[schedule.name] = schedule
    return schedule
