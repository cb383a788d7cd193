"""The all-to-all dispatch itself: while the step is traced, each experts module's forward moves its tokens.

Its forward is swapped for one that runs inside a ``shard_map`` manual over the expert axis and the
batch's row axes: each (token, expert) pair is routed to the device holding its expert, the
module's own forward runs there on its local experts, and the results travel back to be weighted
by the router and summed over the top-k.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._base.errors import ShardingError
from torchshard._base.reported import report
from torchshard._bridge.forwards import replaced_forwards
from torchshard._bridge.loaded import View
from torchshard._bridge.tensors import bound, unwrap, wrap
from torchshard._bridge.vmapped import vmapped_axes
from torchshard._strategies.experts.experts import INTERFACE, Experts, routing_signature, warn_fallback
from torchshard._strategies.experts.option import ExpertDispatch


def _capacity(dispatch: ExpertDispatch, pairs: int, experts: int, local: int) -> int:
    if dispatch.capacity_factor is None:
        return pairs  # every pair a device routes could go to one destination
    return min(pairs, local * math.ceil(dispatch.capacity_factor * pairs / experts))


def _routes(index: jax.Array, local: int, n: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each pair's destination device, its row in that device's buffer, and whether it fits."""
    expert = index.reshape(-1)
    dest = expert // local
    order = jnp.argsort(dest, stable=True)  # pairs keep their order within a destination
    counts = jnp.zeros(n, jnp.int32).at[dest].add(1)
    starts = jnp.cumsum(counts) - counts
    ranked = jnp.arange(expert.shape[0], dtype=jnp.int32) - starts[dest[order]]
    row = jnp.zeros_like(ranked).at[order].set(ranked)
    return dest, row, row < capacity


def _exchange(x: jax.Array, axis: str) -> jax.Array:
    """[n, C, ...] → [n, C, ...]: block i goes to device i; block j of the result came from device j."""
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def _moved(experts: Experts, dispatch: ExpertDispatch, mesh: Mesh, original: Any, x, index, weights, params):
    """The experts' output for these tokens, with every pair computed on its expert's device."""
    n = mesh.shape[experts.axis]
    local = experts.count // n
    tokens, k = index.shape
    # every device routes its own tokens: manual over the batch's axes too, so the routing (a sort
    # and scatters GSPMD would otherwise gather for) stays local and all_to_all runs within groups
    split = math.prod(mesh.shape[a] for a in experts.token_axes)
    if tokens % split:
        raise ShardingError(
            [f"{experts.name}: {tokens} tokens do not split over axes {experts.token_axes} of {split} devices"],
            header="all-to-all expert dispatch cannot split these tokens",
        )
    capacity = _capacity(dispatch, tokens // split * k, experts.count, local)
    dense = weights.shape[1] != k  # [T, experts] scores (GPT-OSS before transformers 5): the chosen ones
    if dense:
        weights = jnp.take_along_axis(weights, index, axis=1)

    def body(x, index, weights, *values):
        values = tuple(v[0] for v in values)  # this device's copy (see `_copies`)
        pairs = index.size
        dest, row, fits = _routes(index, local, n, capacity)
        token = jnp.arange(pairs) // k
        slot = jnp.where(fits, row, capacity)  # out of range: .at[].set(mode="drop") skips it
        send = jnp.zeros((n, capacity, x.shape[-1]), x.dtype).at[dest, slot].set(x[token], mode="drop")
        ids = jnp.zeros((n, capacity), index.dtype).at[dest, slot].set(index.reshape(-1) % local, mode="drop")
        used = jnp.zeros((n, capacity), weights.dtype).at[dest, slot].set(1, mode="drop")
        got, got_ids, got_used = (_exchange(a, experts.axis) for a in (send, ids, used))
        got_ids, got_used = got_ids.reshape(-1, 1), got_used.reshape(-1, 1)
        if dense:  # the module reads its rows' weights at their expert's column
            got_used = jax.nn.one_hot(got_ids[:, 0], local, dtype=got_used.dtype) * got_used
        out = _local_experts(experts, original, local, got.reshape(n * capacity, -1), got_ids, got_used, values)
        back = _exchange(out.reshape(n, capacity, -1), experts.axis)
        picked = back[dest, jnp.minimum(row, capacity - 1)]
        # in the weights' dtype, as transformers weighs and sums its experts' outputs: float32 routing
        # weights round once, at the end, and not three times in bf16 (weights, products, sum)
        scale = jnp.where(fits, weights.reshape(-1), 0)
        dropped = jnp.sum(~fits)
        return (picked * scale[:, None]).reshape(-1, k, picked.shape[-1]).sum(1).astype(x.dtype), dropped[None]

    copies, stacked = _copies(experts, mesh, params)
    rows = PartitionSpec(experts.token_axes)
    manual = frozenset({experts.axis, *experts.token_axes}) | vmapped_axes()
    sharded = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows, rows, rows, *(stacked for _ in params)),
        out_specs=(rows, rows),
        axis_names=manual,
        check_vma=False,
    )
    out, dropped = sharded(x, index, weights, *copies)
    return out, dropped.sum()


def _copies(experts: Experts, mesh: Mesh, params: Sequence[jax.Array]) -> tuple[list[jax.Array], PartitionSpec]:
    """The stacked parameters with a leading dim of one copy per device along the token axes besides the expert
    axis, and the spec that hands each device its copy and its experts.

    Passed in with a spec naming the expert axis alone, a parameter would be replicated over the
    other token axes inside the shard_map, whose transpose then sums its gradient with a ``psum``
    in the partly manual region. JAX lowers that psum's reducer with a sharding annotation (a
    ``copy`` once partitioned), and XLA's CPU pass that widens bf16 all-reduces aborts the process
    on it (``Invalid binary instruction opcode copy``: MixedPrecision on expert × model with a
    data axis). With a copy per device the gradients are summed over the copies outside, by GSPMD.
    """
    others = tuple(a for a in experts.token_axes if a != experts.axis)
    count = math.prod(mesh.shape[a] for a in others)
    copies = [jnp.broadcast_to(p[None], (count, *p.shape)) for p in params]
    return copies, PartitionSpec(others or None, experts.axis)


def _local_experts(experts: Experts, original: Any, local: int, x, ids, used, values) -> jax.Array:
    """The module's own forward on this device's experts (``num_experts`` says how many it holds)."""
    module = experts.module
    count = getattr(module, "num_experts", None)
    try:
        if isinstance(count, int):
            setattr(module, "num_experts", local)  # noqa: B010
        with bound(module, {p: wrap(v) for p, v in zip(experts.params, values, strict=True)}):
            return unwrap(original(wrap(x), wrap(ids), wrap(used)))
    finally:
        if isinstance(count, int):
            setattr(module, "num_experts", count)  # noqa: B010


def _array(value: Any) -> Any:
    """The jax array behind a torchax tensor or a torchax view (some routers return views)."""
    return unwrap(value.torch() if isinstance(value, View) else value)


def _routing_call(signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The call's first three arguments where it passes exactly those (by position or by name), else ``[]``."""
    try:
        passed = signature.bind(*args, **kwargs).arguments if signature is not None else {}
    except TypeError:
        return []
    names = list(signature.parameters)[:3] if signature is not None else []
    return [_array(passed[n]) for n in names] if names and list(passed) == names else []


def _described(value: Any) -> str:
    if isinstance(value, jax.Array):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__


def _call_problem(experts: Experts, values: list[Any]) -> str | None:
    """Why a call is not (hidden states [T, H] float, indices [T, k] integer, weights [T, k] or [T, E] float)."""
    if len(values) == 3 and all(isinstance(v, jax.Array) and v.ndim == 2 for v in values):
        x, index, weights = values
        (tokens, k), floats = index.shape, [jnp.issubdtype(v.dtype, jnp.floating) for v in (x, weights)]
        rows = x.shape[0] == tokens == weights.shape[0]
        if all(floats) and jnp.issubdtype(index.dtype, jnp.integer) and rows and weights.shape[1] in (k, experts.count):
            return None
    got = ", ".join(map(_described, values)) if values else "other arguments than three"
    return f"{experts.name}: called with ({got}), not {INTERFACE} of {experts.count} experts"


_WARNED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # modules a fallback warning has named


def _fallback(experts: Experts, problem: str, fallen: dict[torch.nn.Module, str]) -> None:
    """A call all-to-all cannot move: an error where it was asked for, else noted for one warning."""
    if experts.strict:
        raise ShardingError([problem], header="ExpertDispatch('all_to_all') cannot move this experts module's tokens")
    fallen.setdefault(experts.module, problem)


@contextlib.contextmanager
def dispatching(dispatch: ExpertDispatch, mesh: Mesh, experts: Sequence[Experts]) -> Iterator[None]:
    """While the step is traced, these experts modules move tokens by all-to-all (and report dropped pairs).

    A call that is not (hidden states, expert indices, routing weights) runs the module's own forward
    under the plan's sharding; the default dispatch says so in one warning per module, the first trace.
    """
    fallen: dict[torch.nn.Module, str] = {}
    with replaced_forwards() as replace:
        for e in experts:
            original, signature = e.module.forward, routing_signature(e.module)

            def forward(*args, _e=e, _original=original, _signature=signature, **kwargs):
                values = _routing_call(_signature, args, kwargs)
                problem = _call_problem(_e, values)
                if problem is not None:
                    _fallback(_e, problem, fallen)
                    return _original(*args, **kwargs)
                params = [_array(getattr(_e.module, p)) for p in _e.params]
                x, index, weights = values
                out, lost = _moved(_e, dispatch, mesh, _original, x, index, weights, params)
                if dispatch.capacity_factor is not None:
                    report("dropped_tokens", lost)
                return wrap(out)

            replace(e.module, forward)
        yield
    news = [problem for module, problem in fallen.items() if module not in _WARNED]
    _WARNED.update(fallen)
    warn_fallback(news)
