"""The idle share of a pipeline's loop: one formula for the schedule, the Trainer and the plan search."""

from __future__ import annotations


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1, *, schedule: str | None = None) -> float:
    """The idle fraction of a loop of ``repeats·M + S - 1`` iterations: ``(S-1)/(repeats*M + S-1)``; 0 for one stage.

    Under ``schedule="zero_bubble"`` (weight gradients deferred) the weight gradients have no
    placeholders, and the forwards and input gradients their ``S-1`` each: ``2(S-1)/(3M + 2(S-1))``,
    the three costing alike.

    Examples:
        >>> bubble_fraction(4, 8), bubble_fraction(1, 8), bubble_fraction(4, 8, schedule="zero_bubble")
        (0.2727272727272727, 0.0, 0.2)
    """
    if schedule == "zero_bubble":
        return 2 * (stages - 1) / (3 * repeats * microbatches + 2 * (stages - 1))
    return (stages - 1) / (repeats * microbatches + stages - 1)
