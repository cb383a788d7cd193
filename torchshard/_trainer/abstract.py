"""A Trainer of shapes: the real step of a model built on ``meta``, lowered and compiled but never run."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import NamedSharding

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._base.validate import mismatch_problems
from torchshard._bridge.layer_view import StackedArray
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import jax_dtype
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.precision import MixedPrecision
from torchshard._train.state import Arrays, StateLayout, Structs, TrainState, train_state_structs
from torchshard._trainer.batches import raise_for_batch
from torchshard._trainer.core import Core
from torchshard._trainer.holding import Holding
from torchshard._trainer.trainer import Trainer, core_of


def _leaf_struct(leaf: Any) -> tuple[tuple[int, ...], Any]:
    """(shape, jax dtype) of a batch leaf: a torch tensor (``meta`` too), an array, a ShapeDtypeStruct, a number."""
    if not hasattr(leaf, "dtype"):
        leaf = jnp.asarray(leaf)  # a Python scalar: its shape and dtype are jax's
    dtype = jax_dtype(leaf.dtype) if isinstance(leaf.dtype, torch.dtype) else jnp.dtype(leaf.dtype)
    # an int64 leaf is int32 to JAX without x64, as a real batch's int64 tensor becomes: say so here, where jax
    # 0.12 warns at lowering (an error under -W error) and older versions truncated silently
    return tuple(leaf.shape), jax.dtypes.canonicalize_dtype(dtype)


def abstract_batch(core: Core, batch: Any, *, steps: int | None = None) -> Any:
    """``batch`` as ShapeDtypeStructs with the shardings `Trainer.place_batch` would give its leaves.

    Raises:
        ShardingError: every leaf whose sharded dims do not divide by the mesh axes.
    """
    raise_for_batch(core, jax.tree.leaves(batch), steps=steps)

    def struct(leaf: Any) -> jax.ShapeDtypeStruct:
        shape, dtype = _leaf_struct(leaf)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=core.batch.sharding(leaf))

    return jax.tree.map(struct, batch)


class Shapes(Holding):
    """Shapes and shardings (``jax.ShapeDtypeStruct``) in place of arrays: nothing is placed, owned or bound."""

    def own(
        self,
        model: torch.nn.Module,
        plan: ShardingPlan,
        layout: StateLayout,
        precision: MixedPrecision | None,
        owner: object,
    ) -> torch.nn.Module:
        # nothing is placed: the tensors stay where the model was built (meta), and every step
        # binds the traced state over all of them, as it does for a placed model
        tensors = named_tensors(model)
        problems = mismatch_problems(
            {n: e.shape for n, e in plan.entries.items()},
            {n: tuple(t.shape) for n, t in tensors.items()},
            expected_in="plan",
            found_in="model",
        )
        raise_if_any(problems, header=f"plan does not fit {type(model).__name__}; re-run plan() on this model")
        return model

    def arrays(self, layout: StateLayout, structs: Structs, tensors: dict[str, Any]) -> Arrays:
        return structs  # type: ignore[return-value]  # stand-ins for the arrays a Trainer holds

    def initial_state(
        self,
        transform: optax.GradientTransformation,
        layout: StateLayout,
        structs: tuple[Structs, Structs],
        tensors: dict[str, Any],
        replicated: NamedSharding,
    ) -> TrainState:
        return train_state_structs(transform, *structs, replicated)

    def views(self, model: torch.nn.Module, layout: StateLayout, arrays: Arrays) -> dict[str, StackedArray]:
        return {}  # no arrays to view: the traced step binds every tensor of the model

    def step_args(self, core: Core, batch: Any, *, local: bool = False, steps: int | None = None) -> tuple[Any, ...]:
        return core.state, core.frozen, abstract_batch(core, batch, steps=steps), core.base_key


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

    _holding: ClassVar[Holding] = Shapes()  # what differs from a Trainer: shapes where it holds arrays

    def abstract_batch(self, batch: Any, *, steps: int | None = None) -> Any:
        """``batch`` as ShapeDtypeStructs with the shardings `Trainer.place_batch` would give its leaves.

        Raises:
            ShardingError: every leaf whose sharded dims do not divide by the mesh axes.
        """
        return abstract_batch(core_of(self), batch, steps=steps)

    def step(self, batch: Any, *, local: bool = False) -> dict[str, jax.Array]:
        """Raises: an AbstractTrainer holds shapes, not values (build a `Trainer` to train)."""
        raise ShardingError(
            "an AbstractTrainer holds shapes, not values: it lowers and compiles the step (lower(batch), "
            "torchshard.inspect.memory) but cannot run it; build a Trainer on a placed model to train"
        )
