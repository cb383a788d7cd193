"""init_sharded: build a module with every tensor created directly in its shards."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal

import jax
import numpy as np
import torch
from jax.sharding import Mesh

from torchshard._module_tensors import named_tensors
from torchshard._placement import assign
from torchshard._plan import ShardingPlan, plan
from torchshard._rules import Rules
from torchshard._torchax import env, seeded, unwrap
from torchshard._validate import instance_problems, int_problems, raise_for_arguments


def _materialise(model_fn: Callable[[], torch.nn.Module], p: ShardingPlan, seed: int) -> dict[str, jax.Array]:
    names = [e.name for e in p.unique_entries()]
    shardings = [p[n] for n in names]
    tx = env()

    def build(key: jax.Array) -> list[jax.Array]:
        # torch init consumes torchax's RNG: seed it for this trace only, so its tracers stay inside
        with seeded(jax.random.PRNGKey(key)), tx, warnings.catch_warnings():
            # 64-bit tensors are narrowed unless x64 is on, as `shard` does; JAX would warn per tensor
            warnings.filterwarnings("ignore", "Explicitly requested dtype int64", UserWarning)
            with torch.device("jax"):
                model = model_fn()
            tensors = named_tensors(model)
            return [unwrap(tensors[n]) for n in names]

    arrays = jax.jit(build, out_shardings=shardings)(np.uint32(seed))
    return dict(zip(names, arrays, strict=True))


def _build_on_meta(model_fn: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.device("meta"):
        model = model_fn()
    raise_for_arguments(
        instance_problems("model_fn()", model, torch.nn.Module, "a torch.nn.Module (model_fn builds the model)"),
        header="invalid init_sharded() arguments",
    )
    return model


def init_sharded(
    model_fn: Callable[[], torch.nn.Module],
    mesh: Mesh,
    rules: Rules | Iterable[Any] | None = None,
    *,
    default: Literal["replicate", "error"] = "replicate",
    seed: int | None = None,
) -> torch.nn.Module:
    """Builds ``model_fn()`` with every tensor created directly sharded, never whole on one device.

    The model is first built on ``meta`` to plan it; then ``model_fn`` runs once inside a jitted
    function whose outputs are pinned to the plan, so XLA computes each shard where it lives.
    Deterministic inits (constants, ``ones``, ``arange``...) equal eager torch; random ones draw
    from JAX's RNG seeded by ``seed`` (default: ``torch.initial_seed()``).

    Args:
        model_fn: builds the module (no arguments); must not move tensors to a device itself.
        mesh: the device mesh.
        rules: as for `plan`.
        default: as for `plan`.
        seed: RNG seed for random initialisers.

    Returns:
        The module (built on meta) whose tensors are sharded torchax tensors.

    Raises:
        ArgumentError: ``model_fn`` is not callable or returns no module, or ``seed`` is not an int.
        ShardingError: the plan is invalid (see `plan`).

    Example:
        >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64))
        >>> model = init_sharded(build, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=1024))
        >>> model[0].weight.jax().sharding.spec, model[0].weight.device
        (P('data', None), device(type='jax', index=0))
        >>> float(model[1].weight.jax().sum())  # deterministic inits equal eager torch
        64.0
    """
    problems = [] if callable(model_fn) else [f"model_fn must be a callable that builds the model, got {model_fn!r}"]
    problems += int_problems("seed", seed, minimum=0, none="torch.initial_seed()")
    raise_for_arguments(problems, header="invalid init_sharded() arguments")
    model = _build_on_meta(model_fn)
    p = plan(model, mesh, rules, default=default)
    seed = torch.initial_seed() % 2**32 if seed is None else seed
    return assign(model, _materialise(model_fn, p, seed), p)
