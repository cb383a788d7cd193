"""What a compiled step communicates and holds: its collectives and its memory per device."""

from torchshard._report.compiled import CompiledMemory, memory
from torchshard._report.hlo import KINDS, Collective, axes_of, parse_hlo
from torchshard._report.inspection import CollectiveStats, collectives
from torchshard._train.abstract import AbstractTrainer

__all__ = [
    "KINDS",
    "AbstractTrainer",
    "Collective",
    "CollectiveStats",
    "CompiledMemory",
    "axes_of",
    "collectives",
    "memory",
    "parse_hlo",
]
