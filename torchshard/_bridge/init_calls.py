"""``torch.nn.init`` while `init_sharded` builds: torchshard's replacement where torch's cannot be traced, and which
call on which tensor failed.

Calls are found in the failure's traceback, not intercepted: transformers wraps ``torch.nn.init``'s
functions while ``_init_weights`` runs and calls torch's own from a table it took at import, and most
of torch's functions never reach a torch-function mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

import torch

from torchshard._bridge.init_ops import trunc_normal_

# torch's own functions, by their code (calculate_gain computes a number, it fills no tensor)
TORCH_INITS: dict[CodeType, str] = {
    getattr(torch.nn.init, name).__code__: name for name in torch.nn.init.__all__ if name != "calculate_gain"
}


@contextlib.contextmanager
def traceable_inits() -> Iterator[None]:
    """Inside the block, ``torch.nn.init.trunc_normal_`` samples without a Python loop on tensor values.

    torch 2.13 rejects out-of-bounds samples until none is left (``if not mask.any()``), which a trace
    cannot run. Its body is the private ``_no_grad_trunc_normal_``, looked up at each call: replacing
    that one name covers every caller, transformers' wrappers (which hold torch's function) included.
    """
    init: Any = torch.nn.init
    original: Callable[..., Any] | None = getattr(init, "_no_grad_trunc_normal_", None)
    if original is not None:  # private: a torch without it keeps its own (an error here, never a silent value)
        init._no_grad_trunc_normal_ = trunc_normal_
    try:
        yield
    finally:
        if original is not None:
            init._no_grad_trunc_normal_ = original


def failed_init(error: BaseException) -> str | None:
    """``torch.nn.init.<name>() on <tensor>`` for the outermost init call ``error`` went through, else None."""
    frames = [frame for frame, _ in _walk(error.__traceback__)]
    for i, frame in enumerate(frames):
        name = TORCH_INITS.get(frame.f_code)
        if name is not None:
            tensor = frame.f_locals.get("tensor")
            return f"torch.nn.init.{name}() on {_tensor_name(tensor, frames[:i])}"
    return None


def _walk(tb: Any) -> Iterator[tuple[FrameType, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _tensor_name(tensor: Any, callers: list[FrameType]) -> str:
    """``Module.attr`` for the innermost caller holding a module that owns ``tensor``; its dtype and shape."""
    if not isinstance(tensor, torch.Tensor):
        return f"{type(tensor).__name__} {tensor!r:.40}"
    described = f"({str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)})"
    for frame in reversed(callers):
        for value in frame.f_locals.values():
            if isinstance(value, torch.nn.Module):
                for attr, held in [*value._parameters.items(), *value._buffers.items()]:
                    if held is tensor:
                        return f"{type(value).__name__}.{attr} {described}"
    return f"a tensor {described}"
