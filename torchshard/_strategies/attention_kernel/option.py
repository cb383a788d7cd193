"""``Trainer(attention_kernel=)``: ``"auto"`` (None is it) or one of `kernels.KERNELS` forced, and their check."""

from __future__ import annotations

from typing import Any

from torchshard._bridge.ops import kernels

DEFAULT = "auto"


def problems(value: Any) -> list[str]:
    """Why ``value`` cannot be ``attention_kernel=`` (None is the default), or nothing.

    Examples:
        >>> problems(None)
        []
    """
    return kernels.check_kernel(DEFAULT if value is None else value, what="attention_kernel")
