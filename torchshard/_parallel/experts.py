"""Expert parallelism that moves tokens: each (token, expert) pair goes to its expert's device by ``all_to_all``.

A mixture-of-experts *experts module* holds its experts stacked on dim 0 of every parameter and is
called as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
(transformers' experts modules, and any plain-torch module written the same way). When the plan
shards those parameters' dim 0 over a mesh axis, the Trainer swaps the module's forward, for the
trace only, for one that runs inside a ``shard_map`` manual over that axis: route pairs to the
device holding their expert, run the module's own forward there on its local experts, send the
results back, weight them by the router and sum over the top-k. The router, its top-k and its
normalisation are the model's own and run before, unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._base.errors import ShardingError
from torchshard._base.reported import report
from torchshard._base.specs import entry_axes
from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.forwards import replaced_forwards
from torchshard._bridge.loaded import View
from torchshard._bridge.tensors import bound, unwrap, wrap
from torchshard._parallel.vmapped import vmapped_axes

KINDS = ("all_to_all", "gspmd")
_CALL = ("hidden_states", "top_k_index", "top_k_weights")


@dataclasses.dataclass(frozen=True)
class ExpertDispatch:
    """How tokens meet their experts when the plan shards experts over a mesh axis (``Trainer(expert_dispatch=)``).

    Args:
        kind: ``"all_to_all"`` (the default where the plan shards experts): every (token, expert)
            pair travels to the device holding its expert and back, two ``all_to_all`` calls over
            the expert axis per layer and direction. ``"gspmd"``: the plan's sharding alone, XLA
            decides (it gathers the tokens or the experts; kept for comparison).
        capacity_factor: ``None`` is dropless: each device's send buffer has room for every pair
            it routes to any one device (``tokens · top_k`` rows per destination, a static
            worst case, since XLA's shapes are static and CPU has no ``ragged_all_to_all``), so
            results equal eager torch exactly. A number ``c > 0`` caps the rows sent to each
            device at ``ceil(c · tokens · top_k / experts)`` per expert it holds; the pairs over
            the cap are dropped (they add nothing to their token's output).

    Raises:
        ArgumentError: an unknown kind or a capacity factor that is not a finite number > 0.

    Example:
        >>> ExpertDispatch()
        ExpertDispatch(kind='all_to_all', capacity_factor=None)
        >>> ExpertDispatch("gspmd").kind
        'gspmd'
    """

    kind: str = "all_to_all"
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        problems = [] if self.kind in KINDS else [f"kind={self.kind!r} must be one of {list(KINDS)}"]
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c <= 0):
            problems.append(f"capacity_factor={c!r} must be None (dropless) or a finite number > 0, e.g. 1.25")
        raise_for_arguments(problems, header="invalid ExpertDispatch arguments")


@dataclasses.dataclass(frozen=True)
class Experts:
    """One experts module the plan shards by expert: its name, the axis and its stacked parameters."""

    name: str
    module: torch.nn.Module
    axis: str
    params: tuple[str, ...]
    count: int  # experts, before sharding
    token_axes: tuple[str, ...] = ()  # the axes the batch's rows (so the tokens) are split over


def _takes_routing(module: torch.nn.Module) -> bool:
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names[:3] == list(_CALL)


def _dim0_axis(spec: PartitionSpec | None) -> str | None:
    if spec is None or len(spec) == 0 or not isinstance(spec[0], str):
        return None
    return spec[0]


def find_experts(model: torch.nn.Module, specs: dict[str, PartitionSpec]) -> list[Experts]:
    """The experts modules whose every stacked parameter the plan shards on dim 0 over one axis."""
    found = []
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params or not _takes_routing(module):
            continue
        full = {p: f"{name}.{p}" if name else p for p in params}
        axes = {_dim0_axis(specs.get(full[p])) for p in params}
        counts = {t.shape[0] for t in params.values()}
        if len(axes) == 1 and None not in axes and len(counts) == 1:
            found.append(Experts(name, module, axes.pop(), tuple(params), counts.pop()))  # type: ignore[arg-type]
    return found


def _row_axes(batch_spec: PartitionSpec) -> tuple[str, ...]:
    return entry_axes(batch_spec[0] if len(batch_spec) else None)


def experts_problems(experts: Sequence[Experts], mesh: Mesh, batch_spec: PartitionSpec) -> list[str]:
    """What keeps all-to-all dispatch from running on these experts with this batch sharding."""
    problems = []
    batch_axes = _row_axes(batch_spec)
    for e in experts:
        n = mesh.shape[e.axis]
        if e.count % n:
            problems.append(f"{e.name}: {e.count} experts do not split over axis {e.axis!r} of size {n}")
        if e.axis not in batch_axes:
            problems.append(
                f"{e.name}: the batch is not split over the expert axis {e.axis!r} (batch_spec={tuple(batch_spec)}); "
                f"all-to-all dispatch needs each expert device to route its own tokens: pass "
                f"batch_spec=((..., {e.axis!r}),), e.g. (('data', {e.axis!r}),), or ExpertDispatch('gspmd')"
            )
    return problems


def expert_dispatch_for(
    model: torch.nn.Module, plan: Any, batch_spec: PartitionSpec, dispatch: ExpertDispatch | None
) -> tuple[ExpertDispatch | None, list[Experts]]:
    """The dispatch a Trainer uses and the experts modules it moves tokens for.

    ``None`` (the default) means all-to-all where it can run (the plan shards experts by expert and
    the batch is split over that axis) and the plan's own sharding otherwise; an explicit
    ``ExpertDispatch("all_to_all")`` that cannot run is a `ShardingError` saying why.
    """
    if dispatch is not None and not isinstance(dispatch, ExpertDispatch):
        raise_for_arguments([f"expert_dispatch must be an ExpertDispatch(...) or None, got {type(dispatch).__name__}"],
                            header="invalid Trainer arguments")  # fmt: skip
    if dispatch is not None and dispatch.kind == "gspmd":
        return dispatch, []
    experts = find_experts(model, {name: entry.spec for name, entry in plan.entries.items()})
    problems = experts_problems(experts, plan.mesh, batch_spec)
    experts = [dataclasses.replace(e, token_axes=_row_axes(batch_spec)) for e in experts]
    if dispatch is None:
        return (None, []) if problems or not experts else (ExpertDispatch(), experts)
    if not experts:
        problems.append(
            "no experts module to dispatch to: none has parameters stacked on dim 0 that the plan shards over "
            "an axis and a forward(hidden_states, top_k_index, top_k_weights); shard them with "
            "presets.expert_parallel or hf_rules(expert_axis=...)"
        )
    if problems:
        raise ShardingError(problems, header="ExpertDispatch('all_to_all') cannot run on this model, plan and batch")
    return dispatch, experts


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

    def body(x, index, weights, *values):
        pairs = index.size
        dest, row, fits = _routes(index, local, n, capacity)
        token = jnp.arange(pairs) // k
        slot = jnp.where(fits, row, capacity)  # out of range: .at[].set(mode="drop") skips it
        send = jnp.zeros((n, capacity, x.shape[-1]), x.dtype).at[dest, slot].set(x[token], mode="drop")
        ids = jnp.zeros((n, capacity), index.dtype).at[dest, slot].set(index.reshape(-1) % local, mode="drop")
        used = jnp.zeros((n, capacity), weights.dtype).at[dest, slot].set(1, mode="drop")
        got, got_ids, got_used = (_exchange(a, experts.axis) for a in (send, ids, used))
        out = _local_experts(experts, original, local, got.reshape(n * capacity, -1), got_ids.reshape(-1, 1),
                             got_used.reshape(-1, 1), values)  # fmt: skip
        back = _exchange(out.reshape(n, capacity, -1), experts.axis)
        picked = back[dest, jnp.minimum(row, capacity - 1)]
        scale = jnp.where(fits, weights.reshape(-1), 0).astype(picked.dtype)
        dropped = jnp.sum(~fits)
        return (picked * scale[:, None]).reshape(-1, k, picked.shape[-1]).sum(1).astype(x.dtype), dropped[None]

    rows, stacked = PartitionSpec(experts.token_axes), PartitionSpec(experts.axis)
    manual = frozenset({experts.axis, *experts.token_axes}) | vmapped_axes()
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, *(stacked for _ in params)),
                            out_specs=(rows, rows), axis_names=manual, check_vma=False)  # fmt: skip
    out, dropped = sharded(x, index, weights, *params)
    return out, dropped.sum()


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


@contextlib.contextmanager
def dispatching(dispatch: ExpertDispatch, mesh: Mesh, experts: Sequence[Experts]) -> Iterator[None]:
    """While the step is traced, these experts modules move tokens by all-to-all (and report dropped pairs)."""
    with replaced_forwards() as replace:
        for e in experts:
            original = e.module.forward

            def forward(hidden_states, top_k_index, top_k_weights, *, _e=e, _original=original):
                params = [_array(getattr(_e.module, p)) for p in _e.params]
                out, lost = _moved(_e, dispatch, mesh, _original, _array(hidden_states), _array(top_k_index),
                                   _array(top_k_weights), params)  # fmt: skip
                if dispatch.capacity_factor is not None:
                    report("dropped_tokens", lost)
                return wrap(out)

            replace(e.module, forward)
        yield
