"""How a Trainer holds its train state: placed arrays that it owns, the module's tensors bound to them."""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import NamedSharding

from torchshard._base.errors import ShardingError
from torchshard._bridge.layer_view import StackedArray
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import rebind, unwrap
from torchshard._sharding.placement import shard
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.precision import MixedPrecision, store_params
from torchshard._train.state import Arrays, StateLayout, Structs, TrainState, initial_state, layer_views, physical
from torchshard._trainer.batches import place_batch
from torchshard._trainer.core import Core

OWNER = "_torchshard_trainer"  # the module attribute naming the Trainer that owns its tensors (a weak reference)


def take(model: torch.nn.Module, plan: ShardingPlan, precision: MixedPrecision | None, owner: object) -> None:
    """Makes ``owner`` the module's owner; arrays another Trainer may donate are copied first."""
    previous = getattr(model, OWNER, None)
    if previous is not None and previous() is not None:
        tensors = named_tensors(model)
        copies = jax.jit(lambda t: jax.tree.map(jnp.copy, t))({n: unwrap(t) for n, t in tensors.items()})
        rebind(tensors, copies)
    setattr(model, OWNER, weakref.ref(owner))
    if precision is not None:
        store_params(model, plan, precision)


def check_owner(model: torch.nn.Module, owner: object) -> None:
    """Raises unless ``owner`` still owns the module (a newer Trainer's steps would donate its arrays)."""
    ref = getattr(model, OWNER, None)
    if ref is None or ref() is not owner:
        raise ShardingError(
            "another Trainer has been built on this Trainer's module since, and owns its tensors now; "
            "train with the newer Trainer (or deep-copy the module before building a second one)"
        )


class Holding:
    """Placed arrays: the module's tensors moved by the plan, the train state made of them, tensors viewing it.

    `assemble` and the step make and read arrays only through these methods, so a Trainer of
    shapes (`AbstractTrainer`'s `Shapes`) is this class with each of them overridden.
    """

    def own(
        self,
        model: torch.nn.Module,
        plan: ShardingPlan,
        layout: StateLayout,
        precision: MixedPrecision | None,
        owner: object,
    ) -> torch.nn.Module:
        """Places ``model``'s tensors as the plan says and makes ``owner`` their owner; scanned layers are
        placed when they are stacked, so a pipeline stage's devices receive only its layers."""
        stacked = {name for names in layout.stacks().values() for name in names}
        model = shard(model, plan, skip=stacked)
        take(model, plan, precision, owner)
        return model

    def arrays(self, layout: StateLayout, structs: Structs, tensors: dict[str, Any]) -> Arrays:
        """The arrays of ``structs``' keys, from the module's ``tensors`` (scanned layers stacked)."""
        return physical(layout, structs, tensors)

    def initial_state(
        self,
        transform: optax.GradientTransformation,
        layout: StateLayout,
        structs: tuple[Structs, Structs],
        tensors: dict[str, Any],
        replicated: NamedSharding,
    ) -> TrainState:
        """The state before the first step: the params and buffers of ``structs``, a fresh optimizer state."""
        params, buffers = structs
        return initial_state(
            transform, self.arrays(layout, params, tensors), self.arrays(layout, buffers, tensors), params, replicated
        )

    def views(self, model: torch.nn.Module, layout: StateLayout, arrays: Arrays) -> dict[str, StackedArray]:
        """Makes scanned layers' tensors views of the stacked ``arrays``; the stacks by key."""
        return layer_views(model, layout, arrays)

    def step_args(self, core: Core, batch: Any, *, local: bool = False, steps: int | None = None) -> tuple[Any, ...]:
        """The compiled step's (or an evaluation's) arguments: the state, frozen params, placed batch and key."""
        placed = place_batch(core, jax.tree.map(unwrap, batch), local=local, steps=steps)
        core.state = core.given.refresh(core.state)  # a torch optimizer's values now: inputs of the step
        return core.state, core.frozen, placed, core.base_key
