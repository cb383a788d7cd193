"""Where, in a transformers causal LM's own code, tracing its decoding failed, and what that construct is."""

from __future__ import annotations

import linecache
import types

import jax
import torch

from torchshard._train.traced_errors import value_dependent_call

# what tracing raises where the model's code needs what a traced tensor does not have yet: JAX's own errors
# (ConcretizationTypeError, TracerBoolConversionError are TypeErrors) and torch code meeting torchax tensors
TRACING_ERRORS = (TypeError, jax.errors.JAXIndexError)
_LIBRARIES = {"jax", "jaxlib", "torchax", "torch", "torchshard", "numpy", "opt_einsum", "contextlib"}


def _skipped(frame: types.FrameType) -> bool:
    """Whether ``frame`` runs torchshard's, a numerics library's or contextlib's code. Told by its module, not by
    its file's path: a venv may lie under a folder named torchshard (dev.py compat's), a torchax outside one."""
    return str(frame.f_globals.get("__name__", "")).partition(".")[0] in _LIBRARIES


def _where(trace: types.TracebackType | None) -> str:
    """The innermost frame outside the numerics libraries and torchshard: ``path:line (`code`)``."""
    found = ""
    while trace is not None:
        code = trace.tb_frame.f_code
        if not _skipped(trace.tb_frame):
            path = code.co_filename.rsplit("site-packages/", 1)[-1]
            line = " ".join(linecache.getline(code.co_filename, trace.tb_lineno).split())
            found = f"{path}:{trace.tb_lineno} (`{line[:140]}`)" if line else f"{path}:{trace.tb_lineno}"
        trace = trace.tb_next
    return found or "torchshard's decoding"


def _module(trace: types.TracebackType | None, model: torch.nn.Module) -> str:
    """The innermost module of ``model`` whose code is on the traceback, as ``Class 'name'``."""
    names = {id(m): n for n, m in model.named_modules()}
    found = f"{type(model).__name__} (the model)"
    while trace is not None:
        owner = trace.tb_frame.f_locals.get("self")
        if id(owner) in names and names[id(owner)]:
            found = f"{type(owner).__name__} {names[id(owner)]!r}"
        trace = trace.tb_next
    return found


def _construct(err: BaseException) -> str:
    call = value_dependent_call(err)
    if call is not None:
        return f"uses {call}, whose result's shape depends on a tensor's values"
    if isinstance(err, jax.errors.ConcretizationTypeError | jax.errors.TracerBoolConversionError):
        return "needs a traced tensor's value in Python (an if/while on a tensor, bool(), int(), .item())"
    return "runs code that cannot take traced tensors"


def untraceable_message(model: torch.nn.Module, err: BaseException) -> str:
    """What a transformers causal LM ran that generate cannot trace, naming its module and line.

    Examples:
        >>> model = torch.nn.Linear(2, 2)
        >>> untraceable_message(model, TypeError("no"))[:60]
        'generate cannot trace the decoding of Linear: Linear (the mo'
    """
    first = (str(err).strip().splitlines() or [""])[0][:200]
    return (
        f"generate cannot trace the decoding of {type(model).__name__}: {_module(err.__traceback__, model)} "
        f"{_construct(err)}, at {_where(err.__traceback__)}, which raised {type(err).__name__}: {first}. generate "
        f"compiles prefill and every decoding step into one program, where the KV cache's length and every tensor "
        f"are traced (they have no values until it runs), so it refuses this model; transformers' own "
        f"model.generate decodes it in eager torch"
    )
