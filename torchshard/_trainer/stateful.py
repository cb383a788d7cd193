"""The Trainer's train state: reading it, laying it out (`_train/state.py`), binding it to the module, loading one."""

from __future__ import annotations

from typing import Any

import jax
import optax
import torch
from jax.sharding import NamedSharding

from torchshard._bridge.layer_view import LayerView, StackedArray
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import set_array, unwrap
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.optim.given import GivenOptimizer
from torchshard._train.precision import MixedPrecision, stored_dtypes
from torchshard._train.state import (
    Arrays,
    StateLayout,
    Structs,
    TrainState,
    initial_state,
    layer_views,
    physical,
    tensor_structs,
)


class Stateful:
    """The state half of a `Trainer`: its arrays by train-state key, the module's tensors as views of them."""

    plan: ShardingPlan
    layout: StateLayout
    transform: optax.GradientTransformation
    precision: MixedPrecision | None
    _model: torch.nn.Module
    _tensors: dict[str, Any]
    _names: tuple[list[str], list[str], list[str]]
    _state: TrainState
    _frozen: Arrays
    _stacks: dict[str, StackedArray]
    _replicated: NamedSharding
    _base_key: jax.Array
    _window: Any
    _lock: Any
    _given: GivenOptimizer

    @property
    def state(self) -> TrainState:
        return self._state

    @property
    def given_optimizer(self) -> GivenOptimizer:
        """The optimizer as the step applies it: its optax transformation and, for a torch optimizer, its
        translation and each parameter's place in the train state (what torch-format exports read)."""
        return self._given

    @property
    def step_count(self) -> int:
        return int(self._state.step)

    @property
    def rng_key(self) -> jax.Array:
        """Raw key data (uint32) the per-step keys are folded from: part of a resumable state."""
        return self._base_key

    def _structs(self, names: list[str]) -> Structs:
        return tensor_structs(self.plan, self.layout, names, self.tensor_dtypes())

    def _physical(self, names: list[str]) -> Arrays:
        return physical(self.layout, self._structs(names), self._tensors)

    def _initial_state(self) -> TrainState:
        params, buffers, _ = self._names
        return initial_state(
            self.transform, self._physical(params), self._physical(buffers), self._structs(params), self._replicated
        )

    def _views(self) -> None:
        self._stacks = layer_views(
            self._model, self.layout, {**self._state.params, **self._state.buffers, **self._frozen}
        )
        self._tensors = named_tensors(self._model)

    def state_shardings(self) -> TrainState:
        """The pinned sharding of every leaf of `state` (the plan's for params and buffers)."""
        return jax.tree.map(lambda x: x.sharding, self._state)

    def physical_arrays(self) -> Arrays:
        """Every tensor of the module by train-state key (scanned layers stacked): what a checkpoint stores."""
        arrays = {k: unwrap(t) for k, t in self._tensors.items() if not isinstance(t, LayerView)}
        canonical = {self.plan.canonical(n) for n in self.plan}
        arrays = {k: v for k, v in arrays.items() if k in canonical}
        return {**arrays, **self._state.params, **self._state.buffers, **self._frozen}

    def tensor_dtypes(self) -> dict[str, torch.dtype]:
        """The torch dtype each tensor is stored in (the master dtype under `MixedPrecision`)."""
        return stored_dtypes(self.plan, self.precision)

    def _bind(self) -> None:
        arrays = {**self._state.params, **self._state.buffers}
        for key, array in arrays.items():
            if key in self._stacks:
                self._stacks[key].replace(array)
            else:
                set_array(self._tensors[key], array)

    def load_state(self, state: TrainState, *, rng_key: jax.Array | None = None, frozen: Arrays | None = None) -> None:
        """Replaces the training state (e.g. from a checkpoint); arrays must already be placed.

        A torch optimizer's param groups take the state's hyperparameters (a checkpoint's ``lr``, ``betas``...).

        Args:
            state: the new `TrainState`, sharded as `state_shardings` says.
            rng_key: the `rng_key` to continue from (kept if None).
            frozen: new arrays for frozen (``requires_grad=False``) parameters, by train-state key.
        """
        with self._lock:
            self._state, self._window = state, None  # the step count may have changed: read it again
            self._given.adopt(state.opt_state)
            if rng_key is not None:
                self._base_key = rng_key
            if frozen:
                self._frozen = {**self._frozen, **frozen}
                for key, array in frozen.items():
                    if key in self._stacks:
                        self._stacks[key].replace(array)
                    else:
                        set_array(self._tensors[key], array)
            self._bind()
