"""Plain torch tensors a trace read as constants, so that a later in-place write to one can be noticed."""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator

import torch

# (the tensor, its version counter when the trace read its values)
Captures = list[tuple[weakref.ref[torch.Tensor], int]]
_RECORDING: contextvars.ContextVar[Captures | None] = contextvars.ContextVar("torchshard_captures", default=None)


@contextlib.contextmanager
def recording(into: Captures) -> Iterator[None]:
    """Inside the block, every plain tensor a trace reads as a constant is listed in ``into``."""
    token = _RECORDING.set(into)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def record(tensor: torch.Tensor) -> None:
    """Notes that the trace in progress (if any records) read ``tensor``'s values now."""
    into = _RECORDING.get()
    if into is not None and not any(ref() is tensor for ref, _ in into):
        into.append((weakref.ref(tensor), tensor._version))


def changed(captures: Captures) -> str | None:
    """Which recorded tensor was written in place since its values were read, if one was.

    Examples:
        >>> weights, captures = torch.ones(3), []
        >>> with recording(captures):
        ...     record(weights)
        >>> changed(captures) is None
        True
        >>> _ = weights.mul_(2)
        >>> changed(captures)
        'a torch.float32 tensor of shape (3,) captured from outside the model'
    """
    for ref, version in captures:
        tensor = ref()
        if tensor is not None and tensor._version != version:
            return f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)} captured from outside the model"
    return None
