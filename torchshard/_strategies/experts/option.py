"""``Trainer(expert_dispatch=ExpertDispatch(...))``: the option, checked as it is made, and the keyword's check."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torchshard._base.validate import raise_for_arguments

KINDS = ("all_to_all", "gspmd")


@dataclasses.dataclass(frozen=True)
class ExpertDispatch:
    """How tokens meet their experts when the plan shards experts over a mesh axis (``Trainer(expert_dispatch=)``).

    Args:
        kind: ``"all_to_all"`` (the default where the plan shards experts): every (token, expert)
            pair travels to the device holding its expert and back, two ``all_to_all`` calls over
            the expert axis per layer and direction. ``"gspmd"``: the plan's sharding alone, XLA
            decides (it gathers the tokens or the experts; kept for comparison).
        capacity_factor: ``None`` is dropless: each device's send buffer has room for every pair
            it routes to any one device (``tokens · top_k`` rows per destination, a static
            worst case, since XLA's shapes are static and CPU has no ``ragged_all_to_all``), so
            results equal eager torch exactly. A number ``c > 0`` caps the rows sent to each
            device at ``ceil(c · tokens · top_k / experts)`` per expert it holds; the pairs over
            the cap are dropped (they add nothing to their token's output).

    Raises:
        ArgumentError: an unknown kind or a capacity factor that is not a finite number > 0.

    Examples:
        >>> ExpertDispatch()
        ExpertDispatch(kind='all_to_all', capacity_factor=None)
        >>> ExpertDispatch("gspmd").kind
        'gspmd'
    """

    kind: str = "all_to_all"
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        problems = [] if self.kind in KINDS else [f"kind={self.kind!r} must be one of {list(KINDS)}"]
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c <= 0):
            problems.append(f"capacity_factor={c!r} must be None (dropless) or a finite number > 0, e.g. 1.25")
        raise_for_arguments(problems, header="invalid ExpertDispatch arguments")


def check_dispatch(dispatch: Any) -> None:
    """Raises unless ``dispatch`` is None or an `ExpertDispatch`.

    Raises:
        ArgumentError: ``dispatch`` is neither.
    """
    if dispatch is not None and not isinstance(dispatch, ExpertDispatch):
        raise_for_arguments(
            [f"expert_dispatch must be an ExpertDispatch(...) or None, got {type(dispatch).__name__}"],
            header="invalid Trainer arguments",
        )
