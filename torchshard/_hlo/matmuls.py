"""Every matmul of a traced program with its operand dtypes and the name scopes it runs under.

Read from the program as traced (its jaxpr), not from the compiled HLO: XLA:CPU converts bf16 dot
operands to f32 when it compiles, so only the traced program says, on every platform, which
matmuls a bf16 step really asks for in f32. Loops, conditionals, custom derivatives and the
backward's transposes are walked into; a matmul inside a loop counts once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.extend import core as jax_core


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One ``dot_general``: where it runs (its name scopes, outermost first), its operands' dtypes and shapes."""

    scope: str
    lhs: str
    rhs: str
    shapes: tuple[tuple[int, ...], tuple[int, ...]]

    @property
    def float32(self) -> bool:
        """Whether an operand is float32 (a matmul a bf16 policy did not cast)."""
        return "float32" in (self.lhs, self.rhs)


def _walk(jaxpr: Any, outer: str) -> Iterator[Matmul]:
    for eqn in jaxpr.eqns:
        here = "/".join(filter(None, (outer, str(eqn.source_info.name_stack))))
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars[:2])
            yield Matmul(here, str(np.dtype(lhs.dtype)), str(np.dtype(rhs.dtype)), (tuple(lhs.shape), tuple(rhs.shape)))
        for sub in jax_core.jaxprs_in_params(eqn.params):
            yield from _walk(sub, here)


def matmuls_of(traced: jax_core.ClosedJaxpr) -> tuple[Matmul, ...]:
    """The matmuls of a traced program (``jax.jit(f).trace(...).jaxpr``), in program order.

    Examples:
        >>> def f(x, w):
        ...     with jax.named_scope("head"):
        ...         return x.astype(jax.numpy.bfloat16) @ w
        >>> traced = jax.jit(f).trace(np.ones((2, 4), np.float32), np.ones((4, 3), jax.numpy.bfloat16)).jaxpr
        >>> [(m.scope.split("/")[-1], m.lhs, m.float32) for m in matmuls_of(traced)]
        [('head', 'bfloat16', False)]
    """
    return tuple(_walk(traced.jaxpr, ""))
