"""Trainer: forward, backward and the optax update of a sharded torch module as one jitted call."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._errors import raise_if_any
from torchshard._module_tensors import named_tensors
from torchshard._placement import batch_leaf_spec, put, shard
from torchshard._plan import ShardingPlan
from torchshard._process import global_shape
from torchshard._specs import SPEC_HINT, SpecLike, parse_spec, spec_axes
from torchshard._step import Arrays, LossFn, Runtime, Step, TrainState, state_shardings
from torchshard._torchax import rebind, unwrap
from torchshard._validate import (
    describe_mesh,
    instance_problems,
    int_problems,
    raise_for_arguments,
    spec_problems,
)


def _groups(model: torch.nn.Module, plan: ShardingPlan) -> tuple[list[str], list[str], list[str]]:
    """Canonical names split into trainable params, buffers (carried and updated) and frozen params."""
    tensors = named_tensors(model)
    params, buffers, frozen = [], [], []
    for entry in plan.unique_entries():
        if entry.kind == "buffer":
            buffers.append(entry.name)
        elif tensors[entry.name].requires_grad:
            params.append(entry.name)
        else:
            frozen.append(entry.name)
    return params, buffers, frozen


class Trainer:
    """Trains a sharded torch module with one fused, jitted, donated step per call.

    Args:
        model: the module; its tensors are placed by ``plan`` (CPU tensors are moved).
        loss_fn: ``loss_fn(model, batch) -> loss`` in plain torch (or ``(loss, {name: metric})``).
        optimizer: an optax ``GradientTransformation``.
        plan: the `ShardingPlan` of ``model``.
        batch_spec: spec for every batch leaf (default: leading dim over ``"data"``).
        grad_accum_steps: micro-batches per step, accumulated inside the jitted step.
        donate: donate params, buffers and optimizer state to the step (halves their memory).
        seed: seeds the per-step RNG key used by dropout and other random torch ops.
        max_in_flight: steps dispatched before waiting for the oldest (bounds queued work).

    Raises:
        ArgumentError: an argument of the wrong type or value (all listed); nothing is moved.
        ShardingError: the plan does not fit the model.

    Example:
        >>> import optax
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> p = ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=1024))
        >>> loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
        >>> trainer = Trainer(model, loss_fn, optax.adamw(1e-3), p)
        >>> x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        >>> metrics = trainer.step((x, y))
        >>> sorted(metrics), trainer.step_count
        (['grad_norm', 'loss'], 1)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        plan: ShardingPlan,
        *,
        batch_spec: SpecLike = ("data",),
        grad_accum_steps: int = 1,
        donate: bool = True,
        seed: int = 0,
        max_in_flight: int = 8,
    ) -> None:
        _check_args(plan, batch_spec, grad_accum_steps, max_in_flight)
        self.plan = plan
        self.optimizer = optimizer
        self.batch_spec = parse_spec(batch_spec) or PartitionSpec()
        self.grad_accum_steps = grad_accum_steps
        self.max_in_flight = max_in_flight
        self._model = shard(model, plan)
        self._tensors = named_tensors(self._model)
        self._names = _groups(self._model, plan)
        self._replicated = NamedSharding(plan.mesh, PartitionSpec())
        self._base_key = jax.device_put(jax.random.key_data(jax.random.key(seed)), self._replicated)
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._state = self._initial_state()
        step = Step(Runtime(self._model, loss_fn), optimizer, grad_accum_steps, self._constrain_batch)
        self._step_fn = self._compile(step, donate)

    @property
    def mesh(self) -> Mesh:
        """The device mesh the plan places tensors on."""
        mesh = self.plan.mesh
        assert isinstance(mesh, Mesh)  # checked when the Trainer was built
        return mesh

    @property
    def model(self) -> torch.nn.Module:
        """The module, bound to the latest parameters and buffers."""
        return self._model

    @property
    def state(self) -> TrainState:
        return self._state

    @property
    def step_count(self) -> int:
        return int(self._state.step)

    @property
    def rng_key(self) -> jax.Array:
        """Raw key data (uint32) the per-step keys are folded from: part of a resumable state."""
        return self._base_key

    def _arrays(self, names: list[str]) -> Arrays:
        return {n: unwrap(self._tensors[n]) for n in names}

    def _initial_state(self) -> TrainState:
        params_names, buffer_names, _ = self._names
        params = self._arrays(params_names)
        shapes = jax.eval_shape(self.optimizer.init, params)
        shardings = state_shardings(shapes, params, self._replicated)
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self._replicated)
        return TrainState(params, self._arrays(buffer_names), opt_state, step)

    def state_shardings(self) -> TrainState:
        """The pinned sharding of every leaf of `state` (the plan's for params and buffers)."""
        return jax.tree.map(lambda x: x.sharding, self._state)

    def _compile(self, step: Step, donate: bool) -> Callable[..., Any]:
        out = (self.state_shardings(), self._replicated)
        return jax.jit(step.__call__, donate_argnums=(0,) if donate else (), out_shardings=out)

    def _constrain_batch(self, x: jax.Array) -> jax.Array:
        return put(x, self._leaf_sharding(x))

    def _leaf_sharding(self, x: Any) -> NamedSharding:
        return NamedSharding(self.mesh, batch_leaf_spec(x, self.batch_spec))

    def place_batch(self, batch: Any, *, local: bool = False) -> Any:
        """Places every leaf of ``batch`` (torch CPU/torchax tensors, numpy, jax) with ``batch_spec``.

        Args:
            batch: the global batch, the same on every process; or, with ``local``, only this
                process's rows (see `torchshard.distributed.local_batch_slice`).
            local: ``batch`` is this process's slice of the global batch.

        Raises:
            ShardingError: every leaf whose sharded dims do not divide by the mesh axes.
        """
        leaves = jax.tree.leaves(batch)
        problems = [p for i, leaf in enumerate(leaves) for p in self._batch_problems(i, leaf, local=local)]
        raise_if_any(problems, header=f"batch does not fit batch_spec {self.batch_spec} on {describe_mesh(self.mesh)}")
        return jax.tree.map(lambda x: put(x, self._leaf_sharding(x), process_local=local), batch)

    def _batch_problems(self, index: int, leaf: Any, *, local: bool = False) -> list[str]:
        shape = tuple(getattr(leaf, "shape", ()))
        if local:
            what = f"process-local batch leaf #{index}"
            shape, problems = global_shape(shape, self._leaf_sharding(leaf), what=what)
            if problems:
                return problems
        spec = batch_leaf_spec(leaf, self.batch_spec)
        factors = {0: ("grad_accum_steps", self.grad_accum_steps)} if shape else {}
        return spec_problems(f"batch leaf #{index}", shape, spec, self.mesh, factors=factors,
                             fix=lambda multiple: f"use a batch size that is a multiple of {multiple}")  # fmt: skip

    def step(self, batch: Any, *, local: bool = False) -> dict[str, jax.Array]:
        """Runs one training step on ``batch``; returns metrics as unsynchronised jax scalars.

        ``float(metrics["loss"])`` waits for the value; not reading it lets steps overlap,
        up to ``max_in_flight`` queued steps. In a multi-process run the metrics are the same
        on every process.

        Args:
            batch: a pytree (tensor, tuple, dict...) of torch CPU tensors or placed tensors: by
                default the global batch, the same on every process.
            local: ``batch`` holds only this process's rows of the global batch (each host loads
                its own slice; see `torchshard.distributed.local_batch_slice`).

        Returns:
            ``{"loss": ..., "grad_norm": ..., **aux}``.
        """
        args = self._step_args(batch, local=local)
        with jax.set_mesh(self.mesh):  # constrain() inside forward reads the mesh it is traced under
            self._state, metrics = self._step_fn(*args)
        self._bind()
        self._throttle(metrics["loss"])
        return metrics

    def lower(self, batch: Any) -> jax.stages.Lowered:
        """The step lowered for ``batch``, without running it or donating anything.

        Args:
            batch: as for `step`.

        Returns:
            A ``jax.stages.Lowered``; ``.compile().as_text()`` is the partitioned HLO that `step` runs.

        Example:
            >>> model = torch.nn.Linear(16, 4)
            >>> p = ts.plan(model, ts.make_mesh({"data": 8}))
            >>> trainer = Trainer(model, lambda m, b: m(b).square().mean(), __import__("optax").sgd(0.1), p)
            >>> hlo = trainer.lower(torch.randn(32, 16)).compile().as_text()
            >>> "all-reduce" in hlo  # data parallel: the gradients are summed over "data"
            True
        """
        args = self._step_args(batch)
        with jax.set_mesh(self.mesh):
            return self._step_fn.lower(*args)  # type: ignore[attr-defined]

    def _step_args(self, batch: Any, *, local: bool = False) -> tuple[Any, ...]:
        placed = self.place_batch(jax.tree.map(unwrap, batch), local=local)
        return self._state, self._arrays(self._names[2]), placed, self._base_key

    def _throttle(self, marker: jax.Array) -> None:
        self._in_flight.append(marker)
        while len(self._in_flight) > self.max_in_flight:
            self._in_flight.popleft().block_until_ready()

    def _bind(self) -> None:
        rebind(self._tensors, {**self._state.params, **self._state.buffers})

    def load_state(self, state: TrainState, *, rng_key: jax.Array | None = None) -> None:
        """Replaces the training state (e.g. from a checkpoint); arrays must already be placed.

        Args:
            state: the new `TrainState`, sharded as `state_shardings` says.
            rng_key: the `rng_key` to continue from (kept if None).
        """
        self._state = state
        if rng_key is not None:
            self._base_key = rng_key
        self._bind()


def _check_args(plan: ShardingPlan, batch_spec: SpecLike, grad_accum_steps: int, max_in_flight: int) -> None:
    problems = instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    if isinstance(plan, ShardingPlan) and not isinstance(plan.mesh, Mesh):
        problems.append("plan is over an AbstractMesh (no devices): plan the model on a mesh from make_mesh to train")
    problems += int_problems("grad_accum_steps", grad_accum_steps, minimum=1)
    problems += int_problems("max_in_flight", max_in_flight, minimum=1)
    spec = parse_spec(batch_spec)
    if spec is None:
        problems.append(f"batch_spec={batch_spec!r} is not {SPEC_HINT}")
    elif isinstance(plan, ShardingPlan):
        unknown = [a for a in spec_axes(spec) if a not in plan.mesh.shape]
        problems += [f"batch_spec axis {a!r} is not in the mesh {list(plan.mesh.shape)}" for a in unknown]
    raise_for_arguments(problems, header="invalid Trainer arguments")
