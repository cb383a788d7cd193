"""``"zero_bubble"``: 1F1B with each backward cut into its input and weight halves, the weight half deferred.

The weight gradients have no placeholders and the forwards and input gradients their ``S-1``
each: the idle fraction is ``2(S-1)/(3M + 2(S-1))``, the three parts costing alike.
"""

from collections.abc import Callable
from typing import Any

from torchshard._strategies.pipeline import deferred
from torchshard._strategies.pipeline.schedule import Schedule


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """``2(S-1)/(3·repeats·M + 2(S-1))``.

    Examples:
        >>> bubble(4, 8)
        0.2
    """
    return 2 * (stages - 1) / (3 * repeats * microbatches + 2 * (stages - 1))


def _loop() -> Callable[..., Any]:
    return deferred.run


SCHEDULE = Schedule(
    name="zero_bubble",
    summary="1F1B with each backward's weight-gradient half deferred",
    bubble=bubble,
    in_flight=lambda stages, microbatches: min(microbatches, 2 * stages - 1) + stages,  # + the deferred halves
    loop=_loop,
    searched=True,
)
