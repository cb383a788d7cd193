"""Trainer: forward, backward and the optax update of a sharded torch module as one jitted call."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import NamedSharding, PartitionSpec
from torch.nn.utils.stateless import _reparametrize_module

from torchshard._errors import ShardingError, raise_if_any
from torchshard._mesh import describe_mesh
from torchshard._placement import batch_leaf_spec, env, is_jax_tensor, put, rebind, shard, wrap
from torchshard._plan import ShardingPlan, named_tensors
from torchshard._rules import SpecLike, entry_axes, to_spec
from torchshard.distributed import global_shape

LossFn = Callable[[torch.nn.Module, Any], Any]
Arrays = dict[str, jax.Array]


class TrainState(NamedTuple):
    """Everything a step reads and writes: trainable params, carried buffers, optimizer state, step."""

    params: Arrays
    buffers: Arrays
    opt_state: Any
    step: jax.Array


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


def state_shardings(opt_shapes: Any, params: Mapping[str, jax.Array], replicated: NamedSharding) -> Any:
    """Shards each optimizer-state leaf like the param it belongs to (same dict key and shape)."""

    def leaf_sharding(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        for key in reversed(path):
            name = getattr(key, "key", None)
            if name in params and tuple(leaf.shape) == tuple(params[name].shape):
                return params[name].sharding
        return replicated

    return jax.tree_util.tree_map_with_path(leaf_sharding, opt_shapes)


class _Runtime:
    """Binds jax arrays into the torch module for one traced call and reads updated buffers back."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn) -> None:
        self.model = model
        self.loss_fn = loss_fn

    def loss(self, params: Arrays, buffers: Arrays, frozen: Arrays, batch: Any, key: jax.Array):
        tx = env()
        # torch randomness (dropout) draws from torchax's key: give it this step's, for this trace only
        with tx.override_property(prng=key):
            with tx:
                values = {k: wrap(v) for k, v in {**params, **frozen, **buffers}.items()}
                torch_batch = jax.tree.map(wrap, batch)
                with _reparametrize_module(self.model, values, tie_weights=True):
                    out = self.loss_fn(self.model, torch_batch)
            loss, aux = out if isinstance(out, tuple) else (out, {})
            new_buffers = {k: values[k].jax() for k in buffers}
            aux = {k: v.jax() if is_jax_tensor(v) else jnp.asarray(v) for k, v in aux.items()}
            return _scalar(loss), (new_buffers, aux)


def _scalar(loss: Any) -> jax.Array:
    value = loss.jax() if is_jax_tensor(loss) else jnp.asarray(loss)
    if value.shape != ():
        raise ShardingError(f"loss_fn must return a scalar loss tensor, got shape {tuple(value.shape)}.")
    return value


def _micro_batches(batch: Any, k: int) -> Any:
    """[B, ...] → [k, B/k, ...] taking rows i, i+k, ...: each device keeps its own rows (no transfer)."""

    def split(x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


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

    Example:
        >>> loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])
        >>> trainer = Trainer(model, loss_fn, optax.adamw(1e-3), p)  # doctest: +SKIP
        >>> metrics = trainer.step((x, y))  # doctest: +SKIP
        >>> float(metrics["loss"])  # doctest: +SKIP
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
        self.batch_spec = to_spec(batch_spec)
        self.grad_accum_steps = grad_accum_steps
        self.max_in_flight = max_in_flight
        self._model = shard(model, plan)
        self._tensors = named_tensors(self._model)
        self._runtime = _Runtime(self._model, loss_fn)
        self._names = _groups(self._model, plan)
        self._replicated = NamedSharding(plan.mesh, PartitionSpec())
        self._base_key = jax.device_put(jax.random.key_data(jax.random.key(seed)), self._replicated)
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._state = self._initial_state()
        self._step_fn = self._compile(donate)

    @property
    def mesh(self):
        return self.plan.mesh

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
        return {n: self._tensors[n].jax() for n in names}

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

    def _compile(self, donate: bool) -> Callable[..., Any]:
        out = (self.state_shardings(), self._replicated)
        return jax.jit(self._step, donate_argnums=(0,) if donate else (), out_shardings=out)

    def _grads(self, state: TrainState, frozen: Arrays, batch: Any, key: jax.Array):
        grad_fn = jax.value_and_grad(self._runtime.loss, has_aux=True)
        k = self.grad_accum_steps
        if k == 1:
            (loss, (buffers, aux)), grads = grad_fn(state.params, state.buffers, frozen, batch, key)
            return loss, grads, buffers, aux

        def micro(carry, xs):
            index, micro_batch = xs
            buffers, grad_sum, loss_sum = carry
            micro_batch = jax.tree.map(self._constrain_batch, micro_batch)
            micro_key = jax.random.fold_in(key, index)
            (loss, (buffers, aux)), grads = grad_fn(state.params, buffers, frozen, micro_batch, micro_key)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (buffers, grad_sum, loss_sum + loss), aux

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        xs = (jnp.arange(k), _micro_batches(batch, k))
        (buffers, grad_sum, loss_sum), aux = jax.lax.scan(micro, (state.buffers, zeros, 0.0), xs)
        aux = jax.tree.map(lambda a: a.mean(0), aux)
        return loss_sum / k, jax.tree.map(lambda g: g / k, grad_sum), buffers, aux

    def _step(self, state: TrainState, frozen: Arrays, batch: Any, base_key: jax.Array):
        key = jax.random.fold_in(jax.random.wrap_key_data(base_key), state.step)
        loss, grads, buffers, aux = self._grads(state, frozen, batch, jax.random.key_data(key))
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        return TrainState(params, buffers, opt_state, state.step + 1), metrics

    def _constrain_batch(self, x: jax.Array) -> jax.Array:
        return put(x, NamedSharding(self.plan.mesh, self._leaf_spec(x)))

    def _leaf_spec(self, x: Any) -> PartitionSpec:
        return batch_leaf_spec(x, self.batch_spec)

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

    def _leaf_sharding(self, x: Any) -> NamedSharding:
        return NamedSharding(self.mesh, self._leaf_spec(x))

    def _batch_problems(self, index: int, leaf: Any, *, local: bool = False) -> list[str]:
        shape = tuple(getattr(leaf, "shape", ()))
        if local:
            shape, problems = global_shape(shape, self._leaf_sharding(leaf), what=f"process-local batch leaf #{index}")
            if problems:
                return problems
        spec = self._leaf_spec(leaf)
        problems = []
        for dim, entry in enumerate(spec):
            axes = entry_axes(entry)
            size = math.prod(self.mesh.shape[a] for a in axes) * (self.grad_accum_steps if dim == 0 else 1)
            if size and shape[dim] % size:
                accum = f" × grad_accum_steps {self.grad_accum_steps}" if dim == 0 and self.grad_accum_steps > 1 else ""
                problems.append(
                    f"batch leaf #{index} {shape}: dim {dim} (size {shape[dim]}) is not divisible by "
                    f"{' × '.join(axes)} (size {size // (self.grad_accum_steps if dim == 0 else 1)}){accum}; "
                    f"use a batch size that is a multiple of {size}"
                )
        return problems

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
            >>> hlo = trainer.lower(batch).compile().as_text()  # doctest: +SKIP
        """
        args = self._step_args(batch)
        with jax.set_mesh(self.mesh):
            return self._step_fn.lower(*args)

    def _step_args(self, batch: Any, *, local: bool = False) -> tuple[Any, ...]:
        placed = self.place_batch(jax.tree.map(lambda x: x.jax() if is_jax_tensor(x) else x, batch), local=local)
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
    problems = []
    if not isinstance(plan, ShardingPlan):
        problems.append(f"plan must be a ShardingPlan from torchshard.plan(), got {type(plan).__name__}")
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        problems.append(f"grad_accum_steps={grad_accum_steps!r} must be an int ≥ 1")
    if not isinstance(max_in_flight, int) or max_in_flight < 1:
        problems.append(f"max_in_flight={max_in_flight!r} must be an int ≥ 1")
    try:
        spec = to_spec(batch_spec)
    except TypeError:
        problems.append(f"batch_spec={batch_spec!r} is not a PartitionSpec or tuple of axis names / None")
    else:
        if isinstance(plan, ShardingPlan):
            unknown = [a for e in spec for a in entry_axes(e) if a not in plan.mesh.shape]
            problems += [f"batch_spec axis {a!r} is not in the mesh {list(plan.mesh.shape)}" for a in unknown]
    raise_if_any(problems, header="invalid Trainer arguments")
