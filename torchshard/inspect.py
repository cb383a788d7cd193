"""What a compiled step communicates and holds: its collectives and its memory per device."""

from torchshard._hlo.hardware import PROFILES, Hardware, hardware
from torchshard._hlo.hlo import KINDS, Collective, axes_of, parse_hlo
from torchshard._hlo.matmuls import Matmul
from torchshard._hlo.memory import CompiledMemory
from torchshard._report.compiled import memory
from torchshard._report.inspection import CollectiveStats, collectives, matmuls
from torchshard._search.search import Candidate, search
from torchshard._trainer.abstract import AbstractTrainer

__all__ = [
    "KINDS",
    "PROFILES",
    "AbstractTrainer",
    "Candidate",
    "Collective",
    "CollectiveStats",
    "CompiledMemory",
    "Hardware",
    "Matmul",
    "axes_of",
    "collectives",
    "hardware",
    "matmuls",
    "memory",
    "parse_hlo",
    "search",
]
