"""``torch.no_grad`` regions honoured by torchax tensors: their results are constants to ``jax.grad``.

torch records no graph inside ``torch.no_grad()``, so nothing computed there passes a gradient back.
torchax tensors carry no autograd graph at all: the Trainer differentiates the traced JAX program,
which knows nothing of torch's grad mode. Without this a ``no_grad`` block inside a model's forward
(transformers' HRM runs its early recurrent cycles so: the "k-step gradient") would silently pass
gradients through, and training would differ from eager torch.

A custom ``torch.autograd.Function`` runs its ``forward`` with grad mode off, yet its output carries a
gradient (through its own ``backward``) whenever grad mode was on at ``apply``. torchax differentiates
the forward itself, so inside a Function's forward the mode that counts is the one at ``apply``:
``_applying`` keeps it per thread (transformers' Bloom GELU is such a Function; reentrant
``torch.utils.checkpoint`` is another).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import jax
import torch
from torch.utils import _pytree as torch_pytree

from torchshard._bridge.loaded import Environment, Tensor

_patched = False  # whether torch.autograd.Function.apply records the grad mode (install)
_applying = threading.local()  # .modes: grad mode at each enclosing autograd.Function.apply, innermost last


def _grad_enabled() -> bool:
    """Whether results now pass gradients back: grad mode, or the mode at the innermost Function's apply."""
    modes = getattr(_applying, "modes", None)
    return torch.is_grad_enabled() or bool(modes and modes[-1])


def _recording_apply(original: Any) -> Callable[..., Any]:
    """``Function.apply`` that notes the grad mode it was called in, for the forward it runs.

    ``original`` is the raw descriptor (a Python classmethod in torch 2.13, torch's C one in 2.15),
    bound to the subclass each call is made on.
    """

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        modes = _applying.__dict__.setdefault("modes", [])
        modes.append(torch.is_grad_enabled())
        try:
            return original.__get__(None, cls)(*args, **kwargs)
        finally:
            modes.pop()

    return apply


def _constant(result: Any, inputs: set[int]) -> Any:
    """``result`` with each new torchax tensor's value behind ``stop_gradient`` (in place: same objects)."""
    for leaf in torch_pytree.tree_leaves(result):
        # an input returned again (an in-place op) keeps its value: torch leaves its history alone too
        if isinstance(leaf, Tensor) and id(leaf) not in inputs:
            leaf._elem = jax.lax.stop_gradient(leaf._elem)
    return result


def _honouring_no_grad(dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` whose results inside ``torch.no_grad()`` pass no gradient back, as in eager torch."""

    def no_grad_dispatch(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        result = dispatch(func, types, args, kwargs)
        if _grad_enabled():
            return result
        inputs = {id(x) for x in torch_pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor)}
        return _constant(result, inputs)

    return no_grad_dispatch


def install(tx: Environment) -> None:
    """Wraps ``tx``'s dispatch so ``torch.no_grad`` regions stop gradients."""
    tx.dispatch = _honouring_no_grad(tx.dispatch)
    global _patched
    # once per process: eager torch is unaffected (the wrapper only records the mode and calls through)
    if not _patched:
        function: Any = torch.autograd.Function
        function.apply = classmethod(_recording_apply(inspect.getattr_static(function, "apply")))
        _patched = True
