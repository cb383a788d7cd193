"""Expert parallelism that moves tokens: each (token, expert) pair goes to its expert's device by ``all_to_all``.

A mixture-of-experts *experts module* holds its experts stacked on dim 0 of every parameter and is
called as ``experts(hidden_states [T, H], expert_indices [T, k], routing_weights [T, k]) -> [T, H]``,
the three by position whatever their names (transformers' experts modules, GPT-OSS's among them, and
any plain-torch module written the same way; ``[T, experts]`` scores are taken too). When the plan
shards those parameters' dim 0 over a mesh axis, the Trainer swaps the module's forward, for the
trace only, for one that runs inside a ``shard_map`` manual over that axis: route pairs to the
device holding their expert, run the module's own forward there on its local experts, send the
results back, weight them by the router and sum over the top-k. The router, its top-k and its
normalisation are the model's own and run before, unchanged. Here: which modules are experts and
whether dispatch can run; the option is in `option`, the swap itself in `all_to_all`.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._base.errors import ShardingError
from torchshard._base.specs import entry_axes
from torchshard._strategies.experts.option import ExpertDispatch, check_dispatch


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
# what an experts module's forward takes first, by position whatever the names
INTERFACE = "(hidden states [T, H], expert indices [T, k], routing weights [T, k] or [T, experts])"


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
        f"{type(module).__name__}.forward{_signature_text(module)} does not take {INTERFACE} as its first "
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
    check_dispatch(dispatch)
    if dispatch is not None and dispatch.kind == "gspmd":
        return dispatch, []
    specs = {name: entry.spec for name, entry in plan.entries.items()}
    experts, unroutable = find_experts(model, specs), _unroutable(model, specs)
    problems = experts_problems(experts, plan.mesh, batch_spec)
    experts = [dataclasses.replace(e, token_axes=_row_axes(batch_spec), strict=dispatch is not None) for e in experts]
    if dispatch is None:
        warn_fallback(unroutable + problems)
        return (None, []) if problems or not experts else (ExpertDispatch(), experts)
    if not experts:
        problems += [
            *unroutable,
            "no experts module to dispatch to: none has parameters stacked on dim 0 that the plan shards over "
            f"an axis and a forward taking {INTERFACE} as its first three positional arguments; shard them "
            "with presets.expert_parallel or hf_rules(expert_axis=...)",
        ]
    if problems:
        raise ShardingError(problems, header="ExpertDispatch('all_to_all') cannot run on this model, plan and batch")
    return dispatch, experts


def warn_fallback(reasons: Sequence[str]) -> None:
    """One `ExpertDispatchWarning` listing each module the default dispatch leaves to the plan, and why."""
    if reasons:
        lines = "".join(f"\n  - {r}" for r in reasons)
        warnings.warn(
            f"expert_dispatch=None keeps the plan's sharding (GSPMD, no all-to-all) for:{lines}\n"
            "pass expert_dispatch=ExpertDispatch('gspmd') to choose that without this warning",
            ExpertDispatchWarning,
            stacklevel=4,
        )
