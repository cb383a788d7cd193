"""A stage's backward cut in two: the input gradient, which the previous stage waits for, and the rest, which can wait.

The pullback's jaxpr (traced once, calls inlined) is cut by dead-code elimination: the equations
the input gradient needs run first; the others (each matmul's weight gradient ``x^T dy`` and
whatever only they need) run later, from the residuals and what the first part hands over (the
output cotangents ``dy`` of the layers: the *stash*). Nothing is computed twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

# call-like primitives whose bodies are inlined before the cut, so that a jitted function's weight gradient
# is not dragged into the first part with its input gradient
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
# data movement the second part redoes on what the first hands over, rather than the first handing over both an
# array and its view (a layer's dy ``[b, s, d]`` for its bias gradient and ``[b*s, d]`` for its weight gradient)
_VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim", "convert_element_type",
                    "copy"})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Split:
    """A pullback ``(residual leaves, cotangent) -> gradients`` as two functions: `first` and `second`."""

    invars: tuple[Any, ...]  # the flat jaxpr's inputs: the residual leaves, then the output cotangent
    consts: tuple[tuple[Any, Any], ...]  # (constvar, value)
    first_eqns: tuple[Any, ...]
    second_eqns: tuple[Any, ...]
    first_out: Any  # the input gradient's var
    outvars: tuple[Any, ...]  # every gradient leaf, the input gradient's among them
    stash: tuple[Any, ...]  # the vars `second` reads that neither the residuals nor its own equations give
    treedef: Any  # of the pullback's output
    at: int  # the input gradient's leaf index

    def stash_avals(self) -> list[jax.ShapeDtypeStruct]:
        """The shapes and dtypes of what `first` hands to `second` (what a deferred backward keeps)."""
        return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in self.stash]

    def first(self, residuals: Sequence[jax.Array], g: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """(the input gradient, the stash) from the residual leaves and the output cotangent."""
        env = self._env(residuals, g)
        _evaluate(self.first_eqns, env)
        return _read(env, self.first_out), [_read(env, v) for v in self.stash]

    def second(self, residuals: Sequence[jax.Array], stash: Sequence[jax.Array]) -> Any:
        """The pullback's output with the input gradient left out (None)."""
        env = {**self._env(residuals, None), **dict(zip(self.stash, stash, strict=True))}
        _evaluate(self.second_eqns, env)
        leaves = [None if i == self.at else _read(env, v) for i, v in enumerate(self.outvars)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _env(self, residuals: Sequence[jax.Array], g: jax.Array | None) -> dict[Any, Any]:
        env = dict(self.consts)
        env.update(zip(self.invars[:-1], residuals, strict=True))
        if g is not None:
            env[self.invars[-1]] = g
        return env


def split(pullback: Callable[[Sequence[Any], Any], Any], residuals: Sequence[Any], g: Any, at: int) -> Split:
    """``pullback(residual leaves, g)`` cut at its output leaf ``at`` (the input gradient), from shapes alone.

    Trace it as it runs: the equations are bound again as they are, so a pullback traced unbatched
    and then run under ``vmap`` is not the same program where it has a ``shard_map`` (a tiny Llama
    under ContextParallel got wrong gradients that way; a transpose traced unbatched finds its
    inputs unvarying over the vmapped axes).

    Args:
        pullback: the function to cut; its output is a pytree of gradients.
        residuals: the residual leaves' shapes and dtypes.
        g: the output cotangent's shape and dtype.
        at: the leaf of the output that is the input gradient.
    """
    traced, out = jax.make_jaxpr(lambda r, g: pullback(r, g), return_shape=True)(list(residuals), g)
    treedef = jax.tree_util.tree_structure(out)
    flat = jax.make_jaxpr(lambda *args: _inlined(traced.jaxpr, traced.consts, args))(*residuals, g)
    jaxpr = flat.jaxpr
    eqns = tuple(jaxpr.eqns)
    first_out = jaxpr.outvars[at]
    first = _needed(eqns, [first_out])
    rest = [v for i, v in enumerate(jaxpr.outvars) if i != at]
    second = _needed(eqns, rest) - first
    made = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    while moved := {
        made[v] for v in _stash(jaxpr, eqns, second, rest) if v in made and eqns[made[v]].primitive.name in _VIEWS
    }:
        second |= moved
    return Split(
        tuple(jaxpr.invars),
        tuple(zip(jaxpr.constvars, flat.consts, strict=True)),
        tuple(eqns[i] for i in sorted(first)),
        tuple(eqns[i] for i in sorted(second)),
        first_out,
        tuple(jaxpr.outvars),
        _stash(jaxpr, eqns, second, rest),
        treedef,
        at,
    )


def _stash(jaxpr: Any, eqns: Sequence[Any], second: set[int], rest: Sequence[Any]) -> tuple[Any, ...]:
    """What the equations ``second`` and the outputs ``rest`` read that neither the residuals nor they give."""
    given = {*jaxpr.invars[:-1], *jaxpr.constvars, *(v for i in second for v in eqns[i].outvars)}
    read = [v for i in sorted(second) for v in eqns[i].invars] + list(rest)
    return tuple(dict.fromkeys(v for v in read if not isinstance(v, Literal) and v not in given))


def _needed(eqns: Sequence[Any], outs: Iterable[Any]) -> set[int]:
    """The indices of the equations ``outs`` depend on."""
    live = {v for v in outs if not isinstance(v, Literal)}
    found = set()
    for i in reversed(range(len(eqns))):
        if any(v in live for v in eqns[i].outvars):
            found.add(i)
            live.update(v for v in eqns[i].invars if not isinstance(v, Literal))
    return found


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, Literal) else env[v]


def _evaluate(eqns: Iterable[Any], env: dict[Any, Any]) -> None:
    """Bind each equation's primitive on the values in ``env`` (traced as the caller traces), adding its outputs."""
    for eqn in eqns:
        args = [_read(env, v) for v in eqn.invars]
        # the layers' name scopes (their state_dict prefixes) kept, so that HLO and traces still name them
        scope = str(eqn.source_info.name_stack)
        with eqn.ctx.manager, jax.named_scope(scope) if scope else contextlib.nullcontext():
            out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out], strict=True))


def _inlined(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """``jaxpr`` evaluated with the bodies of its calls evaluated in its place (traced: one flat jaxpr)."""
    env = dict(zip(jaxpr.constvars, consts, strict=True)) | dict(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CALLS:
            body = eqn.params["jaxpr"]
            out = _inlined(body.jaxpr, body.consts, [_read(env, v) for v in eqn.invars])
            env.update(zip(eqn.outvars, out, strict=True))
        else:
            _evaluate([eqn], env)
    return [_read(env, v) for v in jaxpr.outvars]
