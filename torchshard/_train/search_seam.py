"""The search part of the strategy seam: the mesh axis and the choices a strategy gives ``plan --search``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

# the layout option of gradient accumulation: the Trainer's own keyword, which a candidate passes it as such (a search
# option sets it where no strategy takes its counts: a pipeline's micro-batches off stage meshes)
GRAD_ACCUM = "grad_accum_steps"


class SearchedLayout(Protocol):
    """What a ``plan --search`` candidate tells each strategy: its mesh degrees and the options its strategies'
    search choices set (`SearchOption.sets`)."""

    @property
    def axes(self) -> dict[str, int]: ...

    def degree(self, axis: str) -> int: ...

    def option(self, key: str, default: Any = None) -> Any: ...


def _no_idle(layout: Any) -> float:
    return 0.0


def _no_traffic(layout: Any, dims: Any, activation_bytes: float, layers: float) -> float:
    return 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchAxis:
    """How ``plan --search`` lays out, splits and costs a strategy's mesh axis.

    Attributes:
        name: the mesh axis (``"stage"``, ``"context"``, ``"expert"``).
        fits: ``(model dims, sequence length, degree) -> bool``: the axis may have this size for the model
            (dims has ``layers``, ``heads``, ``kv_heads``, ``experts``, ``hidden``, any of them None).
        batch_dim: the batch dim its devices split (0: rows, 1: the sequence), or None.
        outer: laid out before ``data`` in the mesh (its devices need the fewest fast links).
        splits_weights: each device holds 1/degree of the weights (a pipeline's stages, experts).
        splits_layers: each device runs 1/degree of the layers (a pipeline's stages).
        needs_scan: the layout runs the stack scanned (a pipeline stacks its layers).
        plan_keyword: the `hf_rules` keyword that puts the plan's tensors on the axis (``expert_axis``).
        rows: ``layout -> count`` of micro-batches its strategy splits each step's rows into there.
        recomputes: ``layout -> bool``: the layout's backward replays each layer's forward (a remat schedule).
        idle: ``layout -> fraction`` of the devices' time it leaves idle (a pipeline's bubble).
        traffic: ``(layout, dims, local activation bytes, layers per stage) -> bytes`` per step over links.
        label: ``layout -> words`` the search table's configuration column gives the strategy (``" pipeline M=4"``).
    """

    name: str
    fits: Callable[[Any, int, int], bool]
    batch_dim: int | None = None
    outer: bool = False
    splits_weights: bool = False
    splits_layers: bool = False
    needs_scan: bool = False
    plan_keyword: str | None = None
    rows: Callable[[Any], int] = lambda layout: 1
    recomputes: Callable[[Any], bool] = lambda layout: False
    idle: Callable[[Any], float] = _no_idle
    traffic: Callable[[Any, Any, float, float], float] = _no_traffic
    label: Callable[[Any], str] = lambda layout: ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchOption:
    """A choice ``plan --search`` varies for a strategy: one `search` keyword and one ``plan --search`` flag.

    The search tries every value on every mesh (each value's layout options, `sets`, given to the
    candidate; `Strategy.searched` reads them off it). Counts are tried first: a batch that does not
    split into a layout's micro-batches skips the rest of its options.

    Attributes:
        name: the keyword and the flag (``--name``, underscores as dashes).
        help: the flag's help: what its values are.
        tried: ``() -> values`` tried by default.
        allowed: ``() -> values`` it may be asked to try; None: its values are counts (ints ≥ 1).
        keys: every layout option its values may set (`GRAD_ACCUM` among them where it sets that).
        sets: ``(mesh axes, value) -> {key: value}``: the layout options a value sets on a mesh; ``{}`` where
            the strategy has no use for it there (that mesh gets one layout, not one per value).
        prefer: ``(layout, the values searched) -> sort key``: of a mesh's layouts the lowest is compiled first
            (what fits most: e.g. the variant holding the fewest activations); None: no preference.
    """

    name: str
    help: str
    tried: Callable[[], Sequence[Any]]
    allowed: Callable[[], Sequence[Any]] | None = None
    keys: tuple[str, ...]
    sets: Callable[[dict[str, int], Any], Mapping[str, Any]]
    prefer: Callable[[Any, Sequence[Any]], Any] | None = None
