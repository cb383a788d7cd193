"""``Trainer(fused_loss=)``: the values it takes (True, False or "tokamax"; None is True) and their check."""

from __future__ import annotations

from typing import Any

from torchshard._bridge.ops import tokamax_attention

OPTIONS = "True, False or 'tokamax'"
TOKAMAX = "tokamax"


def asks_tokamax(value: Any) -> bool:
    """Whether ``value`` is ``"tokamax"`` (read without ``==`` on a non-string, which an array would broadcast)."""
    return isinstance(value, str) and value == TOKAMAX


def problems(value: Any) -> list[str]:
    """Why ``value`` cannot be ``fused_loss=``, or nothing.

    Examples:
        >>> problems("yes")
        ["fused_loss must be True, False or 'tokamax', got 'yes'"]
    """
    if value is not None and not isinstance(value, bool) and not asks_tokamax(value):
        return [f"fused_loss must be {OPTIONS}, got {value!r:.40}"]
    if asks_tokamax(value) and (missing := tokamax_attention.missing()) is not None:
        return [f"fused_loss='tokamax' cannot run here: {missing}"]
    return []
