"""torch's runtime assertions (``_assert_async``, ``_check_tensor_all``, ``_print``, ...): checked when known.

torchax has no lowering for most of them (torchtitan's RoPE shape check, ``torch._assert_async``,
stopped the first step) and lowers ``_assert_scalar`` / ``_assert_tensor_metadata`` to nothing.
Eagerly each checks and raises torch's ``RuntimeError``; inside a traced step a condition on a
traced value has no value yet, and XLA has no assertion to defer it to, so it is dropped (torch's
own ``_assert_async`` on an accelerator does not stop the caller either). Shapes and dtypes are
known while tracing, so ``_assert_tensor_metadata`` is always checked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchshard._bridge.loaded import Environment, mappings
from torchshard._bridge.registry import register


def _known(value: Any) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _check(condition: Any, message: str) -> None:
    """Raises torch's ``RuntimeError`` if ``condition`` is known and false; a traced one is dropped."""
    if not _known(condition):
        return
    if np.size(condition) != 1:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
    if not bool(np.asarray(condition).reshape(())):
        raise RuntimeError(message)


def assert_async(condition: Any, assert_msg: str = "Expected Tensor with single nonzero value, but got zero") -> None:
    """``aten._assert_async`` (and ``.msg``): a one-element condition tensor must be nonzero."""
    _check(condition, assert_msg)


def functional_assert_async(condition: Any, assert_msg: str, dep_token: Any) -> Any:
    """``aten._functional_assert_async.msg``: the check, then the dependency token it threads."""
    _check(condition, assert_msg)
    return dep_token


def make_dep_token(**_: Any) -> jax.Array:
    """``aten._make_dep_token``: a placeholder tensor that orders functional assertions."""
    return jnp.zeros((), jnp.float32)


def is_all_true(condition: Any) -> jax.Array:
    """``aten._is_all_true``, ``torch._check_tensor_all``'s test: whether every element is true.

    The check then reads it with ``.item()``: a traced condition counts as true, so that the check
    is dropped like the assertions above rather than failing on a value the trace does not have.
    """
    if _known(condition):
        return jnp.all(condition)
    with jax.ensure_compile_time_eval():  # a constant, not staged into the trace: `.item()` reads it
        return jnp.bool_(True)


def assert_scalar(condition: Any, assert_msg: str) -> None:
    """``aten._assert_scalar``: a Python (or known) boolean must be true."""
    _check(condition, assert_msg)


def constrain_range(size: Any, min: int | None = None, max: int | None = None) -> None:
    """``aten.sym_constrain_range`` (and ``_for_size``): a known size must lie in ``[min, max]``."""
    if not _known(size):
        return
    value = int(np.asarray(size))
    if (min is not None and value < min) or (max is not None and value > max):
        raise RuntimeError(f"Invalid value range for {value} between [{min}, {max}].")


def functional_constrain_range(size: Any, min: int | None, max: int | None, dep_token: Any) -> Any:
    """``aten._functional_sym_constrain_range`` (and ``_for_size``): the check, then the token."""
    constrain_range(size, min, max)
    return dep_token


def assert_tensor_metadata(a: Any, size: Any = None, stride: Any = None, dtype: Any = None, **_: Any) -> None:
    """``aten._assert_tensor_metadata``: sizes and dtype as torch checks them (JAX has no strides or devices).

    The dtype compares as JAX holds it: an int64 tensor is int32 unless x64 is on.
    """
    if size is not None and list(a.shape) != list(size):
        raise RuntimeError(f"Tensor sizes mismatch! Expected: {list(size)}, Got: {list(a.shape)}")
    expected = mappings.t2j_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype  # torchax may convert it
    if expected is not None and a.dtype != jax.dtypes.canonicalize_dtype(expected):
        raise RuntimeError(f"Tensor dtype mismatch! Expected: {dtype}, Got: {a.dtype}")


def print_(s: str) -> None:
    """``aten._print``: prints ``s`` each time the op runs (in a compiled step: each step), as torch does."""
    jax.debug.callback(functools.partial(print, s))  # the user's own print op: stdout is its contract


def install(tx: Environment) -> None:
    """Registers the lowerings in ``tx``."""
    aten = torch.ops.aten
    lowerings: dict[Any, Callable[..., Any]] = {
        aten._assert_async.default: assert_async,
        aten._assert_async.msg: assert_async,
        aten._functional_assert_async.msg: functional_assert_async,
        aten._make_dep_token.default: make_dep_token,
        aten._assert_scalar.default: assert_scalar,
        aten._is_all_true.default: is_all_true,
        aten._assert_tensor_metadata.default: assert_tensor_metadata,
        aten.sym_constrain_range.default: constrain_range,
        aten.sym_constrain_range_for_size.default: constrain_range,
        aten._functional_sym_constrain_range.default: functional_constrain_range,
        aten._functional_sym_constrain_range_for_size.default: functional_constrain_range,
        aten._print.default: print_,
    }
    for op, impl in lowerings.items():
        register(tx, op, impl, jax_function=True, needs_env=False)
        # a call with no tensor argument reaches torchax as the overload packet, which its own no-ops answer first
        register(tx, op.overloadpacket, impl, jax_function=True, needs_env=False)
