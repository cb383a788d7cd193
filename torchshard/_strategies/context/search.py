"""What ``plan --search`` needs of context parallelism: its axis, the degrees that fit and its ring's traffic."""

from __future__ import annotations

from typing import Any

from torchshard._strategies.context.option import ContextParallel
from torchshard._train.search_seam import SearchAxis, SearchedLayout


def searched(layout: SearchedLayout) -> ContextParallel | None:
    """A candidate's `ContextParallel`: on a mesh with a context axis, the default one."""
    return ContextParallel() if layout.axes.get(AXIS.name, 1) > 1 else None


def _fits(dims: Any, seq: int, degree: int) -> bool:
    return degree == 1 or seq % (2 * degree) == 0  # load-balanced: 2·degree equal chunks


def _ring(layout: Any, dims: Any, activation_bytes: float, layers: float) -> float:
    # each layer's keys and values go round the ring, forward and backward (K, V, dK, dV: ~6 passes)
    kv = (dims.hidden or 0) * (dims.kv_heads or 1) / (dims.heads or 1) / layout.degree("model")
    return 6 * layers * activation_bytes * kv * (layout.degree(AXIS.name) - 1)


AXIS = SearchAxis(name="context", fits=_fits, batch_dim=1, traffic=_ring)
