"""A Trainer of shapes: the real step of a model built on ``meta``, lowered and compiled but never run."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._base.validate import describe_mesh, mismatch_problems
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import jax_dtype
from torchshard._train.state import Arrays, TrainState, train_state_structs
from torchshard._trainer.trainer import Trainer


def _leaf_struct(leaf: Any) -> tuple[tuple[int, ...], Any]:
    """(shape, jax dtype) of a batch leaf: a torch tensor (``meta`` too), an array, a ShapeDtypeStruct, a number."""
    if not hasattr(leaf, "dtype"):
        leaf = jnp.asarray(leaf)  # a Python scalar: its shape and dtype are jax's
    dtype = jax_dtype(leaf.dtype) if isinstance(leaf.dtype, torch.dtype) else jnp.dtype(leaf.dtype)
    # an int64 leaf is int32 to JAX without x64, as a real batch's int64 tensor becomes: say so here, where jax
    # 0.12 warns at lowering (an error under -W error) and older versions truncated silently
    return tuple(leaf.shape), jax.dtypes.canonicalize_dtype(dtype)


class AbstractTrainer(Trainer):
    """A `Trainer` whose train state is shapes and shardings (``jax.ShapeDtypeStruct``), never arrays.

    It takes a model built on the ``meta`` device and the same arguments as `Trainer`, and builds
    the step with the Trainer's own code, so ``lower(batch).compile()`` is the program a real
    Trainer would run, for a mesh of devices that need only exist (``use_cpu_devices(256)``), with
    no array of the model allocated. ``batch`` leaves may be ``jax.ShapeDtypeStruct`` s or ``meta``
    tensors. It cannot `step`. `torchshard.inspect.memory` reads its compiled memory.

    Raises:
        ShardingError: as `Trainer`, and when the plan's names or shapes differ from the model's.

    Examples:
        >>> import optax
        >>> with torch.device("meta"):
        ...     model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 8))
        >>> p = ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp())
        >>> trainer = AbstractTrainer(model, lambda m, b: m(b).square().mean(), optax.adamw(1e-3), p)
        >>> trainer.state.params["0.weight"].sharding.spec
        P('data', None)
        >>> compiled = trainer.lower(jax.ShapeDtypeStruct((64, 1024), np.float32)).compile()
        >>> compiled.memory_analysis().argument_size_in_bytes > 3 * 4 * (1024 * 4096 + 4096 * 8) // 8
        True
    """

    def _own(self, model: torch.nn.Module) -> torch.nn.Module:
        # nothing is placed: the tensors stay where the model was built (meta), and every step
        # binds the traced state over all of them, as it does for a placed model
        tensors = named_tensors(model)
        problems = mismatch_problems(
            {n: e.shape for n, e in self.plan.entries.items()},
            {n: tuple(t.shape) for n, t in tensors.items()},
            expected_in="plan",
            found_in="model",
        )
        raise_if_any(problems, header=f"plan does not fit {type(model).__name__}; re-run plan() on this model")
        return model

    def _physical(self, names: list[str]) -> Arrays:
        return self._structs(names)  # type: ignore[return-value]  # stand-ins for the arrays a Trainer holds

    def _initial_state(self) -> TrainState:
        params_names, buffer_names, _ = self._names
        params, buffers = self._structs(params_names), self._structs(buffer_names)
        return train_state_structs(self.transform, params, buffers, self._replicated)

    def _views(self) -> None:
        pass  # no arrays to view: the traced step binds every tensor of the model

    def abstract_batch(self, batch: Any, *, steps: int | None = None) -> Any:
        """``batch`` as ShapeDtypeStructs with the shardings `Trainer.place_batch` would give its leaves.

        Raises:
            ShardingError: every leaf whose sharded dims do not divide by the mesh axes.
        """
        leaves = jax.tree.leaves(batch)
        problems = [p for i, leaf in enumerate(leaves) for p in self._batch_problems(i, leaf, steps=steps)]
        raise_if_any(problems, header=f"batch does not fit batch_spec {self.batch_spec} on {describe_mesh(self.mesh)}")

        def struct(leaf: Any) -> jax.ShapeDtypeStruct:
            shape, dtype = _leaf_struct(leaf)
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._batch.sharding(leaf))

        return jax.tree.map(struct, batch)

    def _step_args(self, batch: Any, *, local: bool = False, steps: int | None = None) -> tuple[Any, ...]:
        return self._state, self._frozen, self.abstract_batch(batch, steps=steps), self._base_key

    def step(self, batch: Any, *, local: bool = False) -> dict[str, jax.Array]:
        """Raises: an AbstractTrainer holds shapes, not values (build a `Trainer` to train)."""
        raise ShardingError(
            "an AbstractTrainer holds shapes, not values: it lowers and compiles the step (lower(batch), "
            "torchshard.inspect.memory) but cannot run it; build a Trainer on a placed model to train"
        )
