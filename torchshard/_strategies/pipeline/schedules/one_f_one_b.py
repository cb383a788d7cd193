"""``"1f1b"``: one forward and one backward per stage per tick, each micro-batch's loss at the last stage."""

from collections.abc import Callable
from typing import Any

from torchshard._strategies.pipeline import ticks
from torchshard._strategies.pipeline.schedule import Schedule


def _loop() -> Callable[..., Any]:
    return ticks.run


SCHEDULE = Schedule(
    name="1f1b",
    summary="a forward and a backward per stage per tick, the loss at the last stage",
    in_flight=lambda stages, microbatches: min(microbatches, 2 * stages - 1),
    loop=_loop,
    searched=True,
)
