"""A Trainer's train state as its parts read and replace it: shardings, checkpointed arrays, binding, loading."""

from __future__ import annotations

import jax

from torchshard._bridge.layer_view import LayerView
from torchshard._bridge.tensors import set_array, unwrap
from torchshard._train.state import Arrays, TrainState
from torchshard._trainer.core import Core


class StateIO:
    """Reads the train state of ``core`` and binds the module's tensors to it; `load_state` replaces it.

    Args:
        core: the Trainer's shared state.
    """

    def __init__(self, core: Core) -> None:
        self.core = core

    def state_shardings(self) -> TrainState:
        """The pinned sharding of every leaf of `state` (the plan's for params and buffers)."""
        return jax.tree.map(lambda x: x.sharding, self.core.state)

    def physical_arrays(self) -> Arrays:
        """Every tensor of the module by train-state key (scanned layers stacked): what a checkpoint stores."""
        core = self.core
        arrays = {k: unwrap(t) for k, t in core.tensors.items() if not isinstance(t, LayerView)}
        canonical = {core.plan.canonical(n) for n in core.plan}
        arrays = {k: v for k, v in arrays.items() if k in canonical}
        return {**arrays, **core.state.params, **core.state.buffers, **core.frozen}

    def bind(self) -> None:
        """Binds the module's tensors to the state's params and buffers (after a step replaced them)."""
        self._set({**self.core.state.params, **self.core.state.buffers})

    def _set(self, arrays: Arrays) -> None:
        for key, array in arrays.items():
            if key in self.core.stacks:
                self.core.stacks[key].replace(array)
            else:
                set_array(self.core.tensors[key], array)

    def load_state(self, state: TrainState, *, rng_key: jax.Array | None = None, frozen: Arrays | None = None) -> None:
        """Replaces the state (`Trainer.load_state`), the optimizer's param groups and the bound tensors."""
        core = self.core
        with core.lock:
            core.state = state
            core.given.adopt(state.opt_state)
            if rng_key is not None:
                core.base_key = rng_key
            if frozen:
                core.frozen = {**core.frozen, **frozen}
                self._set(frozen)
            self.bind()
