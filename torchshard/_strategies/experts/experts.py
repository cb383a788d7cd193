"""Expert parallelism that moves tokens: each (token, expert) pair goes to its expert's device by ``all_to_all``.

A mixture-of-experts *experts module* holds its experts stacked on dim 0 of every parameter and is
called as ``experts(hidden_states [T, H], expert_indices [T, k], routing_weights [T, k]) -> [T, H]``,
the three by position whatever their names (transformers' experts modules, GPT-OSS's among them, and
any plain-torch module written the same way; ``[T, experts]`` scores are taken too). When the plan
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
import warnings
import weakref
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
from torchshard._bridge.vmapped import vmapped_axes

KINDS = ("all_to_all", "gspmd")


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

    Examples:
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
    strict: bool = False  # asked for explicitly: a call that does not fit is an error, not a fallback


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_INTERFACE = "(hidden states [T, H], expert indices [T, k], routing weights [T, k] or [T, experts])"


class ExpertDispatchWarning(UserWarning):
    """The default expert dispatch kept the plan's sharding (no all-to-all) for a module the plan shards by expert."""


def routing_signature(module: torch.nn.Module) -> inspect.Signature | None:
    """The forward's signature where its first three parameters can be passed by position, else ``None``.

    Those three are taken by meaning, whatever their names: hidden states, expert indices, routing
    weights (transformers' ``top_k_index``/``top_k_weights``, GPT-OSS's ``router_indices``/``routing_weights``).
    """
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    return signature if len(params) >= 3 and all(p.kind in _POSITIONAL for p in params[:3]) else None


def _stacked(params: dict[str, torch.Tensor]) -> bool:
    """Experts stacked on dim 0: one leading size, matrices (≥ 3-D) among them, biases (2-D) at least.

    The ranks are read first: a module may hold 0-d parameters (CLIP's ``logit_scale``), which have no dim 0.
    """
    return (
        all(t.ndim >= 2 for t in params.values())
        and any(t.ndim >= 3 for t in params.values())
        and len({t.shape[0] for t in params.values()}) == 1
    )


def _dim0_axis(spec: PartitionSpec | None) -> str | None:
    if spec is None or len(spec) == 0 or not isinstance(spec[0], str):
        return None
    return spec[0]


def _sharded_stacks(model: torch.nn.Module, specs: dict[str, PartitionSpec]) -> Iterator[tuple[str, Any, str, Any]]:
    """(name, module, axis, params) of each module whose stacked parameters the plan shards on dim 0 over one axis."""
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params or not _stacked(params):
            continue
        axes = {_dim0_axis(specs.get(f"{name}.{p}" if name else p)) for p in params}
        axis = axes.pop() if len(axes) == 1 else None
        if axis is not None:
            yield name, module, axis, params


def find_experts(model: torch.nn.Module, specs: dict[str, PartitionSpec]) -> list[Experts]:
    """The experts modules whose every stacked parameter the plan shards on dim 0 over one axis."""
    found = []
    for name, module, axis, params in _sharded_stacks(model, specs):
        if routing_signature(module) is not None:
            count = next(iter(params.values())).shape[0]
            found.append(Experts(name, module, axis, tuple(params), count))
    return found


def _unroutable(model: torch.nn.Module, specs: dict[str, PartitionSpec]) -> list[str]:
    """Why each module that looks like experts sharded by expert (several stacked parameters) takes no routing."""
    return [
        f"{name or 'the model'}: its experts are sharded over {axis!r}, but "
        f"{type(module).__name__}.forward{_signature_text(module)} does not take {_INTERFACE} as its first "
        f"three positional arguments"
        for name, module, axis, params in _sharded_stacks(model, specs)
        if len(params) >= 2 and routing_signature(module) is None
    ]


def _signature_text(module: torch.nn.Module) -> str:
    try:
        return str(inspect.signature(module.forward))
    except (TypeError, ValueError):
        return "(...)"


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
    the batch is split over that axis) and the plan's own sharding otherwise, said once by an
    `ExpertDispatchWarning` naming each module left to the plan and why; an explicit
    ``ExpertDispatch("all_to_all")`` that cannot run is a `ShardingError` saying why.
    """
    if dispatch is not None and not isinstance(dispatch, ExpertDispatch):
        raise_for_arguments(
            [f"expert_dispatch must be an ExpertDispatch(...) or None, got {type(dispatch).__name__}"],
            header="invalid Trainer arguments",
        )
    if dispatch is not None and dispatch.kind == "gspmd":
        return dispatch, []
    specs = {name: entry.spec for name, entry in plan.entries.items()}
    experts, unroutable = find_experts(model, specs), _unroutable(model, specs)
    problems = experts_problems(experts, plan.mesh, batch_spec)
    experts = [dataclasses.replace(e, token_axes=_row_axes(batch_spec), strict=dispatch is not None) for e in experts]
    if dispatch is None:
        _warn_fallback(unroutable + problems)
        return (None, []) if problems or not experts else (ExpertDispatch(), experts)
    if not experts:
        problems += [
            *unroutable,
            "no experts module to dispatch to: none has parameters stacked on dim 0 that the plan shards over "
            f"an axis and a forward taking {_INTERFACE} as its first three positional arguments; shard them "
            "with presets.expert_parallel or hf_rules(expert_axis=...)",
        ]
    if problems:
        raise ShardingError(problems, header="ExpertDispatch('all_to_all') cannot run on this model, plan and batch")
    return dispatch, experts


def _warn_fallback(reasons: Sequence[str]) -> None:
    if reasons:
        lines = "".join(f"\n  - {r}" for r in reasons)
        warnings.warn(
            f"expert_dispatch=None keeps the plan's sharding (GSPMD, no all-to-all) for:{lines}\n"
            "pass expert_dispatch=ExpertDispatch('gspmd') to choose that without this warning",
            ExpertDispatchWarning,
            stacklevel=4,
        )


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
    return f"{experts.name}: called with ({got}), not {_INTERFACE} of {experts.count} experts"


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
    _warn_fallback(news)
