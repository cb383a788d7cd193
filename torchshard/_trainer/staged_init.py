"""init_sharded with a strategy that lays out layers (a pipeline): each stage's layers created on its own devices,
stacked as the Trainer keeps them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._base.validate import instance_problems, raise_for_arguments
from torchshard._bridge.layer_view import view_stacks
from torchshard._sharding import init as sharded
from torchshard._sharding.placement import assign
from torchshard._sharding.rules import Rules
from torchshard._strategies import STRATEGIES, bind_all
from torchshard._train.state import StateLayout, tensor_structs
from torchshard._train.strategy import Setting


def _problems(given: dict[str, Any]) -> list[str]:
    """Why the strategy keywords of an init_sharded call are wrong: unknown, not laying out layers, or a wrong type."""
    problems = []
    for keyword, option in given.items():
        strategy = STRATEGIES.get(keyword)
        if strategy is None:
            raise TypeError(f"init_sharded() got an unexpected keyword argument {keyword!r}")
        if not strategy.lays_out:
            takes = [s.keyword for s in STRATEGIES.values() if s.lays_out]
            problems.append(f"{keyword}: the model is built the same with or without it; init_sharded takes {takes}")
        else:
            problems += instance_problems(keyword, option, strategy.option, f"None or a {strategy.option.__name__}")
    return problems


def init_sharded(
    model_fn: Callable[[], torch.nn.Module],
    mesh: Mesh,
    rules: Rules | Iterable[Any] | None = None,
    *,
    default: Literal["replicate", "error"] = "replicate",
    seed: int | None = None,
    **strategies: Any,
) -> torch.nn.Module:
    """Builds ``model_fn()`` with every tensor created directly sharded, never whole on one device.

    The model is first built on ``meta`` to plan it; then ``model_fn`` runs inside a jitted
    function whose outputs are pinned to the plan, so XLA computes each shard where it lives.
    Deterministic inits (constants, ``ones``, ``arange``...) equal eager torch; random ones draw
    from JAX's RNG seeded by ``seed`` (default: ``torch.initial_seed()``).

    With ``pipeline`` (the `Pipeline` the Trainer will take), the stack it splits is created stage
    by stage: each stage's layers by a call that runs on that stage's devices alone, stacked as a
    pipelined Trainer stores them, so no device ever holds another stage's layers and the Trainer
    takes the stacks as they are. The values equal those built without ``pipeline`` (same seed).

    Args:
        model_fn: builds the module (no arguments); must not move tensors to a device itself.
        mesh: the device mesh.
        rules: as for `plan`.
        default: as for `plan`.
        seed: RNG seed for random initialisers.
        **strategies: ``pipeline=`` the `Pipeline` the model will be trained with, or None (any
            registered strategy that lays out layers, with the option the Trainer will take).

    Returns:
        The module (built on meta) whose tensors are sharded torchax tensors (with ``pipeline``,
        the pipelined layers' tensors read their stage-split stack).

    Raises:
        ArgumentError: ``model_fn`` is not a no-argument callable (a built module is not), it
            returns no module or creates tensors on a device itself; ``mesh`` is not a `Mesh`;
            bad ``rules``, ``default``, ``seed`` or ``pipeline``. Checked before anything is built.
        ShardingError: the plan is invalid (see `plan`); ``model_fn`` raised on ``meta`` or
            built a different model the second time; an init op torchax cannot run; a 64-bit
            integer that 32 bits cannot hold (``jax_enable_x64`` off); a pipeline that does not
            fit the model, mesh or plan (as the Trainer says). The cause is chained.

    Examples:
        >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64))
        >>> model = init_sharded(build, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=1024))
        >>> model[0].weight.jax().sharding.spec, model[0].weight.device
        (P('data', None), device(type='jax', index=0))
        >>> float(model[1].weight.jax().sum())  # deterministic inits equal eager torch
        64.0
        >>> layers = lambda: torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        >>> stack = lambda: torch.nn.ModuleDict({"blocks": layers()})
        >>> staged = init_sharded(stack, ts.make_mesh({"stage": 4, "data": 2}), pipeline=ts.Pipeline())
        >>> staged["blocks"][3].weight.jax().shape  # layer 3, read from the stack only stage 3's devices hold
        (8, 8)
    """
    given = {k: v for k, v in strategies.items() if v is not None}
    raise_for_arguments(_problems(given), header="invalid init_sharded() arguments")
    model, plan, seed = sharded.planned(model_fn, mesh, rules, default=default, seed=seed)
    if not given:
        return assign(model, sharded.materialise(model_fn, plan, seed), plan)
    setting = bind_all(Setting(model, plan, PartitionSpec()), given, caller="init_sharded", every=False)[1]
    layout = StateLayout(setting.groups)
    stacks = layout.stacks()
    dtypes = {n: e.dtype for n, e in plan.entries.items()}
    structs = tensor_structs(setting.plan, layout, [n for names in stacks.values() for n in names], dtypes)
    arrays = sharded.materialise(model_fn, plan, seed, {k: (stacks[k], structs[k].sharding) for k in stacks})
    assign(model, {k: a for k, a in arrays.items() if k not in stacks}, plan)
    view_stacks(model, {k: (stacks[k], arrays[k]) for k in stacks})  # as a scanned Trainer's layers read them
    return model
