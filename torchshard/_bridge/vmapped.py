"""The mesh axes a pipeline's ``vmap(spmd_axis_name=...)`` is tracing over, for shard_maps traced inside it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_AXES: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("torchshard_vmapped_axes", default=frozenset())


@contextlib.contextmanager
def vmapped_over(axis: str) -> Iterator[None]:
    """Inside the block, code is traced under a ``vmap`` whose ``spmd_axis_name`` is ``axis``.

    A ``shard_map`` traced there must list ``axis`` among its manual axes: JAX's batching rule
    puts the vmapped dim on that axis but leaves it auto, which it then refuses ("Axes mentioned in
    manual_axis_type ... should be of type Manual").
    """
    token = _AXES.set(_AXES.get() | {axis})
    try:
        yield
    finally:
        _AXES.reset(token)


def vmapped_axes() -> frozenset[str]:
    """The axes of the enclosing `vmapped_over` blocks (none outside a pipeline).

    Examples:
        >>> with vmapped_over("stage"):
        ...     sorted(vmapped_axes())
        ['stage']
        >>> vmapped_axes()
        frozenset()
    """
    return _AXES.get()
