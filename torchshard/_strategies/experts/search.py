"""What ``plan --search`` needs of expert parallelism: its expert axis and the degrees that fit the model."""

from __future__ import annotations

from typing import Any

from torchshard._train.search_seam import SearchAxis


def _fits(dims: Any, seq: int, degree: int) -> bool:
    return degree == 1 or (dims.experts is not None and dims.experts % degree == 0)


# the search gives no option: all-to-all is the default wherever the batch is split over the expert axis
AXIS = SearchAxis(name="expert", fits=_fits, batch_dim=0, splits_weights=True, plan_keyword="expert_axis")
