"""The one write into torchax's op table: registering a lowering, torch-level or JAX-level."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchshard._bridge.loaded import Environment, ops_registry


def register(tx: Environment, op: Any, impl: Callable[..., Any], *, jax_function: bool, needs_env: bool) -> None:
    """Makes ``impl`` the lowering of ``op`` in ``tx``.

    torchax's public ``override_op_definition`` registers torch-level functions only; a JAX-level
    one needs its Operator record in the env's op table (private).
    """
    tx._ops[op] = ops_registry.Operator(
        op, impl, is_jax_function=jax_function, is_user_defined=True, needs_env=needs_env, is_view_op=False
    )
