"""JAX's CPU lowering of a vmapped ``ragged_dot`` fails: it passes numpy integers to ``vmap``'s ``in_axes``.

Where XLA has no ragged-dot instruction (the CPU), JAX lowers ``ragged_dot_general`` through its own
decomposition, which expands the ragged operand with a ``vmap`` over each batch dim. Under a
``vmap`` (a pipeline's stages run their layers so), the batch rule computes the new dimension
numbers with numpy arithmetic, and the decomposition's ``vmap(in_axes=(np.int64(0), 0))`` raises
"vmap in_axes must be an int, None, or (nested) container": every transformers MoE whose experts
call ``torch._grouped_mm`` failed inside a `Pipeline`. The CPU lowering here hands the same
decomposition Python ints; GPU and TPU keep their own lowerings.
"""

from __future__ import annotations

from typing import Any

import jax
from jax._src.interpreters import mlir  # private: the primitive's lowering table has no public face
from jax._src.lax import lax as lax_internal

_installed: list[bool] = []


def _ints(dims: Any) -> Any:
    """``dims`` (nested tuples of dimension numbers) with every integer a Python int."""
    if isinstance(dims, tuple | list):
        return type(dims)(_ints(d) for d in dims)
    return int(dims)


def _impl(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, ragged_dot_dimension_numbers: Any, **params: Any
) -> jax.Array:
    numbers = ragged_dot_dimension_numbers
    fixed = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=_ints(numbers.dot_dimension_numbers),
        lhs_ragged_dimensions=_ints(numbers.lhs_ragged_dimensions),
        rhs_group_dimensions=_ints(numbers.rhs_group_dimensions),
    )
    return lax_internal._ragged_dot_general_impl(lhs, rhs, group_sizes, ragged_dot_dimension_numbers=fixed, **params)


def install() -> None:
    """Registers the CPU lowering once per process (a JAX-wide table, not torchax's environment)."""
    if _installed:
        return
    lowering = mlir.lower_fun(_impl, multiple_results=False)
    mlir.register_lowering(lax_internal.ragged_dot_general_p, lowering, platform="cpu")
    _installed.append(True)
