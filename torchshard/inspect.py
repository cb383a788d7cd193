"""What a compiled step communicates: its collectives, counted and sized from the partitioned HLO."""

from torchshard._report.hlo import KINDS, Collective, axes_of, parse_hlo
from torchshard._report.inspection import CollectiveStats, collectives

__all__ = ["KINDS", "Collective", "CollectiveStats", "axes_of", "collectives", "parse_hlo"]
