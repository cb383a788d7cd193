"""Scalars that code traced inside a training step reports, to be added to that step's metrics."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_REPORTED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("torchshard_reported", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[dict[str, Any]]:
    """Inside the block, `report` adds to the dict it yields (values of one name are summed).

    Examples:
        >>> with collecting() as metrics:
        ...     report("dropped_tokens", 2)
        ...     report("dropped_tokens", 3)
        >>> metrics
        {'dropped_tokens': 5}
        >>> report("ignored", 1)  # outside a step: nobody collects
    """
    token = _REPORTED.set({})
    try:
        yield _REPORTED.get()  # type: ignore[misc]
    finally:
        _REPORTED.reset(token)


def report(name: str, value: Any) -> None:
    """Adds ``value`` to metric ``name`` of the step being traced, if one is."""
    metrics = _REPORTED.get()
    if metrics is not None:
        metrics[name] = metrics[name] + value if name in metrics else value
