"""Module calls traced under ``jax.named_scope`` of their state_dict prefix, so HLO and profiles name torch layers."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import torch
from torch.nn.modules import module as torch_module

_open = threading.local()  # the names of the modules whose calls are being traced here, outermost first


def current_module() -> str:
    """The name of the innermost module call `named_scopes` is tracing on this thread ("" outside any).

    Examples:
        >>> current_module()
        ''
    """
    names = getattr(_open, "names", None)
    return names[-1] if names else ""


@contextlib.contextmanager
def named_scopes(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, each call of a submodule of ``model`` runs under ``jax.named_scope(its name)``.

    The names are ``model.named_modules()``'s (``model.layers.3.self_attn``): what the state_dict
    keys start with. Every op traced inside a call carries the name in its HLO metadata
    (``op_name="jit(step)/.../model.layers.3.self_attn/dot_general"``), which profilers (xprof,
    TensorBoard's profile plugin) show. Torch's global forward hooks open and close the scopes,
    only on this thread and only for ``model``'s modules; the post-hook runs even when a forward
    raises, so the scopes always unwind.

    Examples:
        >>> class Twice(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x * 2
        >>> model = torch.nn.Sequential(Twice())
        >>> def f(y):
        ...     with named_scopes(model):
        ...         return model(y)
        >>> '"jit(f)/0/mul"' in jax.jit(f).lower(1.0).as_text(debug_info=True)
        True
    """
    names = {id(m): name for name, m in model.named_modules() if name}
    owner = threading.get_ident()
    opened: list[contextlib.AbstractContextManager[Any]] = []
    stack: list[str] = getattr(_open, "names", None) or []
    _open.names = stack

    def enter(module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == owner and (name := names.get(id(module))) is not None:
            scope = jax.named_scope(name)
            scope.__enter__()
            opened.append(scope)
            stack.append(name)

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == owner and id(module) in names and opened:
            opened.pop().__exit__(None, None, None)
            stack.pop()

    before = torch_module.register_module_forward_pre_hook(enter)
    after = torch_module.register_module_forward_hook(leave, always_call=True)
    try:
        yield
    finally:
        before.remove()
        after.remove()
        while opened:  # a forward that raised between its hooks (never seen; kept so the name stack unwinds)
            opened.pop().__exit__(None, None, None)
            stack.pop()
