"""The idle share of a pipeline's loop: one formula for the schedule, the Trainer and the plan search."""

from __future__ import annotations


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle fraction of a loop of ``repeats·M + S - 1`` iterations: ``(S-1)/(repeats*M + S-1)``; 0 for one stage.

    Examples:
        >>> bubble_fraction(4, 8), bubble_fraction(1, 8)
        (0.2727272727272727, 0.0)
    """
    return (stages - 1) / (repeats * microbatches + stages - 1)
