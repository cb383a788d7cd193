"""A pipeline schedule: its loop, its idle fraction, what its backward keeps and holds, whether the search tries it.

Every fact about a schedule lives in its `Schedule` (one file under ``schedules/``), read by the
option's checks, the loops, the Trainer binding and the plan search; none of them names a schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torchshard._base.validate import raise_for_arguments


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
DEFAULT_SCHEDULE = "gpipe"  # what `Pipeline`, its `Stages` and a searched pipeline run when no schedule is named


def register(schedule: Schedule) -> Schedule:
    """Adds ``schedule`` under its name.

    Raises:
        ArgumentError: ``schedule`` is no `Schedule`, its name is no non-empty string or is taken by
            another schedule, a function of it is not callable, or it is ``searched`` but not
            ``searchable``; every problem at once, before anything is registered.

    Examples:
        >>> register(Schedule(name="gpipe", summary="?"))
        Traceback (most recent call last):
        ...
        torchshard._base.errors.ArgumentError: invalid pipeline schedule (1 problem):
          - pipeline schedule 'gpipe' is taken by another schedule; give yours another name
    """
    raise_for_arguments(_problems(schedule), header="invalid pipeline schedule")
    SCHEDULES[schedule.name] = schedule
    return schedule


def _problems(schedule: Any) -> list[str]:
    if not isinstance(schedule, Schedule):
        return [f"register takes a Schedule(name=..., summary=..., ...), got {type(schedule).__name__}"]
    name = schedule.name
    if not (isinstance(name, str) and name and name == name.strip()):
        return [f"pipeline schedule name {name!r} must be a non-empty string, as Pipeline(schedule=) takes it"]
    taken = SCHEDULES.get(name)
    problems = [f"pipeline schedule {name!r} is taken by another schedule; give yours another name"] * (
        taken is not None and taken != schedule
    )
    functions = {"bubble": schedule.bubble, "in_flight": schedule.in_flight}
    problems += [
        f"schedule {name!r}: {k} must be a function, got {v!r:.40}" for k, v in functions.items() if not callable(v)
    ]
    if schedule.loop is not None and not callable(schedule.loop):
        problems.append(
            f"schedule {name!r}: loop must be None or a function returning the loop, got {schedule.loop!r:.40}"
        )
    if schedule.searched and not schedule.searchable:
        problems.append(f"schedule {name!r} is searched but not searchable: the search could not try it")
    return problems
