"""Builds a Trainer's `Core`: strategies bound, the module owned and placed, the state made, the step compiled."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import optax
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import raise_if_any
from torchshard._bridge.module_tensors import named_tensors
from torchshard._sharding.plan import ShardingPlan
from torchshard._strategies import bind_all
from torchshard._train.batching import BatchLayout
from torchshard._train.optim.given import given_optimizer
from torchshard._train.precision import stored_dtypes
from torchshard._train.remat import remat_targets, scan_remat
from torchshard._train.scan import find_groups
from torchshard._train.state import (
    StateLayout,
    TrainState,
    shardings_by_key,
    split_names,
    stack_problems,
    tensor_structs,
)
from torchshard._train.step import LossFn, Runtime, Step
from torchshard._train.strategy import Setting, gradient_of, tracing_all
from torchshard._trainer.core import Core, Options
from torchshard._trainer.evaluate import Compiled
from torchshard._trainer.holding import Holding
from torchshard._trainer.retracing import Retracing


def _base_key(seed: int, replicated: NamedSharding) -> jax.Array:
    # made by a jitted call: device_put of a one-device key to a multi-process replicated sharding gave an
    # array whose shards cannot be listed, and a checkpoint could not write it
    return jax.jit(lambda: jax.random.key_data(jax.random.key(seed)), out_shardings=replicated)()


def _compiler(step: Step, state: TrainState, replicated: NamedSharding, donate: bool) -> Callable[[], Any]:
    """A maker of the jitted step, its outputs pinned to the state's shardings (which never change)."""
    out = (jax.tree.map(lambda x: x.sharding, state), replicated)

    def compile_() -> Any:
        fresh = lambda *args: step(*args)  # noqa: E731  # a new function: JAX traces it anew (Retracing)
        return jax.jit(fresh, donate_argnums=(0,) if donate else (), out_shardings=out)

    return compile_


def assemble(
    owner: object,
    holding: Holding,
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation | torch.optim.Optimizer,
    plan: ShardingPlan,
    options: Options,
    chosen: dict[str, Any],
) -> Core:
    """The `Core` of a Trainer ``owner`` built on these (checked) arguments; ``chosen``: its strategy keywords.

    Raises:
        TypeError: a keyword in ``chosen`` that no registered strategy takes.
        ShardingError: a strategy, remat pattern or scanned list that does not fit (as `Trainer` says).
    """
    scanned = Setting(model, plan, options.batch_spec, find_groups(model, options.scan_layers))
    bound, setting = bind_all(scanned, chosen)
    remat = options.remat
    targets = remat_targets(model, remat) if remat is not None else []
    body_policies, targets = scan_remat(setting.groups, targets, remat)
    raise_if_any(stack_problems(setting.groups, plan), header="scan_layers cannot stack this plan")
    layout = StateLayout(setting.groups)
    given = given_optimizer(optimizer, model, plan, layout)  # read before the model moves
    mesh = setting.plan.mesh
    assert isinstance(mesh, Mesh)  # checked by check_trainer_args
    batch = BatchLayout(mesh, options.batch_spec)
    model = holding.own(model, setting.plan, layout, options.precision, owner)
    tensors, names = named_tensors(model), split_names(model, plan)
    replicated = NamedSharding(plan.mesh, PartitionSpec())
    dtypes = stored_dtypes(setting.plan, options.precision)
    params, buffers, frozen_names = (tensor_structs(setting.plan, layout, n, dtypes) for n in names)
    frozen = holding.arrays(layout, frozen_names, tensors)
    state = holding.initial_state(given.transform, layout, (params, buffers), tensors, replicated)
    stacks = holding.views(model, layout, {**state.params, **state.buffers, **frozen})
    given.settle(model)
    policy = remat.jax_policy() if remat is not None else None
    groups, shardings = setting.groups, shardings_by_key({**state.params, **frozen})
    traced = tracing_all(list(bound.values()))
    runtime = Runtime(
        model, loss_fn, options.precision, shardings, groups, tuple(targets), policy, body_policies, batch, traced
    )
    step = Step(
        runtime,
        given.transform,
        options.grad_accum_steps,
        batch,
        options.skip_nonfinite,
        gradient_of(list(bound.values())),
        options.max_grad_norm,
    )
    return Core(
        options=options,
        plan=setting.plan,
        model=model,
        layout=layout,
        given=given,
        batch=batch,
        strategies=bound,
        replicated=replicated,
        names=names,
        tensors=named_tensors(model),  # again: scanned layers' tensors are views now
        stacks=stacks,
        state=state,
        frozen=frozen,
        base_key=_base_key(options.seed, replicated),
        step_fn=Retracing(_compiler(step, state, replicated, options.donate)),
        evaluations=Compiled(runtime),
        lock=threading.RLock(),
    )
