"""A function's vjp residuals, split into those that change with its varying inputs and those that do not."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal


@dataclasses.dataclass(frozen=True)
class Residuals:
    """How the residuals of ``jax.vjp(fn, diff)`` (the leaves of the pullback it returns) split.

    A pipeline stage keeps each micro-batch's residuals from its forward to its backward. Those
    that depend only on the weights (a transposed weight matrix) are the same for every
    micro-batch: computed once, they are not kept once per micro-batch in flight.
    """

    treedef: Any
    varying: tuple[bool, ...]  # per residual: whether it depends on a varying input
    avals: tuple[Any, ...]  # per residual: its shape and dtype

    def split(self, leaves: Sequence[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
        """(the fixed residuals, the varying ones), each in order."""
        if len(leaves) != len(self.varying):
            raise AssertionError(f"a stage's vjp has {len(leaves)} residuals, traced with {len(self.varying)}")
        fixed = [x for x, v in zip(leaves, self.varying, strict=True) if not v]
        return fixed, [x for x, v in zip(leaves, self.varying, strict=True) if v]

    def kept(self) -> list[Any]:
        """The shapes and dtypes of the varying residuals (what a stage keeps per micro-batch in flight)."""
        return [a for a, v in zip(self.avals, self.varying, strict=True) if v]

    def leaves(self, fixed: Sequence[jax.Array], varying: Sequence[jax.Array]) -> list[jax.Array]:
        """The residuals in the pullback's order, from its two kinds (the inverse of `split`)."""
        fixed_it, varying_it = iter(fixed), iter(varying)
        return [next(varying_it) if v else next(fixed_it) for v in self.varying]

    def pullback(self, fixed: Sequence[jax.Array], varying: Sequence[jax.Array]) -> Callable[..., Any]:
        """The pullback rebuilt from its two kinds of residuals."""
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves(fixed, varying))


def residuals(
    pullbacks: Callable[..., Any], args: Sequence[Any], varying: Sequence[bool], *, lead: int = 0
) -> Residuals:
    """The residuals of the pullback ``pullbacks(*args)`` returns, and which depend on the ``varying`` arguments.

    Args:
        pullbacks: returns a pullback (``jax.vjp``'s second output), or ``lead`` dims of them stacked
            (vmapped): traced exactly as the caller later traces it, so the pullback is the same.
        args: its arguments.
        varying: per argument, True where it changes between calls (the micro-batch), False where
            it does not (the weights).
        lead: the stacked dims, left out of the residuals' shapes.
    """
    found: list[Any] = []

    def leaves(*args: Any) -> list[jax.Array]:
        flat, treedef = jax.tree_util.tree_flatten(pullbacks(*args))
        found.append(treedef)
        return flat

    closed = jax.make_jaxpr(leaves)(*args)
    marks = [m for arg, m in zip(args, varying, strict=True) for _ in jax.tree.leaves(arg)]
    avals = tuple(jax.ShapeDtypeStruct(a.shape[lead:], a.dtype) for a in closed.out_avals)
    return Residuals(found[-1], tuple(_dependent(closed.jaxpr, marks)), avals)


def _dependent(jaxpr: Any, marks: Sequence[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on the inputs ``marks`` flags (an equation's outputs on all its inputs)."""
    marked = {v for v, m in zip(jaxpr.invars, marks, strict=True) if m}
    for eqn in jaxpr.eqns:
        given = [not isinstance(v, Literal) and v in marked for v in eqn.invars]
        if not any(given):
            continue
        inner = _inner(eqn)  # a call (jit, custom_jvp): through its body, whose weight-only outputs stay fixed
        outs = _dependent(inner, given) if inner is not None else [True] * len(eqn.outvars)
        marked.update(v for v, out in zip(eqn.outvars, outs, strict=True) if out)
    return [not isinstance(v, Literal) and v in marked for v in jaxpr.outvars]


def _inner(eqn: Any) -> Any:
    """The body of a call-like equation whose inputs and outputs are the equation's, or None."""
    for value in eqn.params.values():
        body = getattr(value, "jaxpr", value)
        if hasattr(body, "eqns") and len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
            return body
    return None
