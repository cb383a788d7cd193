"""Trainer: forward, backward and the optax update of a sharded torch module as one jitted call."""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._base.specs import SpecLike, parse_spec
from torchshard._base.validate import describe_mesh, raise_for_arguments
from torchshard._bridge.layer_view import StackedArray
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import rebind, unwrap
from torchshard._multihost.worker import heartbeat
from torchshard._sharding.placement import put, shard
from torchshard._sharding.plan import ShardingPlan
from torchshard._strategies import bind_all, reserve
from torchshard._train.batching import BatchLayout
from torchshard._train.optim.given import given_optimizer
from torchshard._train.precision import MixedPrecision, store_params
from torchshard._train.remat import RematLike, as_remat, remat_targets, scan_remat
from torchshard._train.scan import ScanLike, find_groups
from torchshard._train.state import (
    StateLayout,
    shardings_by_key,
    split_names,
    stack_problems,
)
from torchshard._train.step import LossFn, Runtime, Step
from torchshard._train.strategy import Setting, gradient_of, leaf_problems, tracing_all
from torchshard._trainer.checks import batch_type_problems, check_trainer_args
from torchshard._trainer.evaluate import Compiled, evaluating, structure, structure_problems
from torchshard._trainer.observed import Observed
from torchshard._trainer.retracing import Retracing
from torchshard._trainer.stateful import Stateful
from torchshard._trainer.strategic import Strategic
from torchshard._trainer.trackers import Tracker


class Trainer(Observed, Stateful, Strategic):
    """Trains a sharded torch module with one fused, jitted, donated step per call.

    Args:
        model: the module; its tensors are placed by ``plan`` (CPU tensors are moved).
        loss_fn: ``loss_fn(model, batch) -> loss`` in plain torch (or ``(loss, {name: metric})``).
        optimizer: an optax ``GradientTransformation``, or a ``torch.optim`` optimizer built on ``model``'s
            parameters, stepped with torch's arithmetic: ``trainer.optimizer``, whose param groups each step
            reads (step a ``torch.optim.lr_scheduler`` on it after `step`; the "From torch.optim" page).
        plan: the `ShardingPlan` of ``model``.
        batch_spec: spec for every batch leaf (default: leading dim over ``"data"``).
        grad_accum_steps: micro-batches per step, accumulated inside the jitted step.
        donate: donate params, buffers and optimizer state to the step (halves their memory).
        seed: seeds the per-step RNG key used by dropout and other random torch ops.
        max_in_flight: steps dispatched before waiting for the oldest (bounds queued work; at
            most 16 on CPU, where XLA aborts with ~30 collective-heavy steps queued).
        precision: a `MixedPrecision` policy (bf16 compute, fp32 master weights); None computes
            in the parameters' own dtype.
        remat: activation checkpointing: a module-name regex, a list of them, or a `Remat`.
        scan_layers: run ModuleLists (or ModuleDicts, as torchtitan keeps its layers) of identical
            blocks as one ``lax.scan`` over stacked weights: ``True`` (every such list), a name or a
            list of names.
        skip_nonfinite: a step whose loss or gradients are not finite changes no parameter,
            buffer or optimizer state; its metrics say ``"skipped": 1.0``.
        max_grad_norm: clip the gradients' global norm to it before the update, as
            ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)`` does.
        log_every: every N steps, loss, throughput, MFU and memory to logger ``torchshard`` and the trackers.
        trackers: `torchshard.track` trackers, or objects with ``log``/``close``; a failing one: `TrackerError`.
        peak_flops: FLOP/s per device for MFU (default: the device's hardware profile; none on CPU).
        **strategies: one keyword per registered parallel strategy. ``pipeline=`` a `Pipeline`: split the
            model's stack of identical layers into stages over a mesh axis and stream micro-batches through
            them (the stack is scanned). ``context=`` a `ContextParallel`: split each batch's sequence (dim 1)
            over a mesh axis and run every ``scaled_dot_product_attention`` in the model as ring (or
            all-gather) attention over it; ``batch_spec`` must split dim 1 over it, e.g. ``("data",
            "context")``. ``expert_dispatch=`` an `ExpertDispatch`: how tokens meet experts the plan shards
            by expert. ``None`` moves them by all-to-all where the batch is split over the expert axis and
            leaves them to the plan's sharding otherwise; ``trainer.strategies["expert_dispatch"]`` says which.
            ``fused_loss=False``: HF causal LMs' loss as written, not chunked by `linear_cross_entropy`;
            ``fused_loss="tokamax"``: by tokamax's fused loss where it takes the call (docs/large-models.md).

    Raises:
        TypeError: a keyword that is no argument and no registered strategy's.
        ArgumentError: an argument of the wrong type or value (all listed); nothing is moved.
        ShardingError: the plan does not fit the model, a remat pattern matches no module, or a
            list cannot be scanned (with why), a pipeline does not fit (with the sizes that do), or
            ``context`` does not fit the mesh and batch_spec.

    Examples:
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
        optimizer: optax.GradientTransformation | torch.optim.Optimizer,
        plan: ShardingPlan,
        *,
        batch_spec: SpecLike = ("data",),
        grad_accum_steps: int = 1,
        donate: bool = True,
        seed: int = 0,
        max_in_flight: int = 8,
        precision: MixedPrecision | None = None,
        remat: RematLike = None,
        scan_layers: ScanLike = False,
        skip_nonfinite: bool = False,
        max_grad_norm: float | None = None,
        log_every: int | None = None,
        trackers: Sequence[Tracker] = (),
        peak_flops: float | None = None,
        **strategies: Any,
    ) -> None:
        check_trainer_args(
            model,
            loss_fn,
            optimizer,
            plan,
            batch_spec,
            grad_accum_steps,
            max_in_flight,
            precision,
            donate=donate,
            seed=seed,
            skip_nonfinite=skip_nonfinite,
            max_grad_norm=max_grad_norm,
            observing=(log_every, trackers, peak_flops),
        )
        remat_ = as_remat(remat)
        self.precision = precision
        self.batch_spec = parse_spec(batch_spec) or PartitionSpec()
        self.grad_accum_steps = grad_accum_steps
        self.max_in_flight = max_in_flight
        scanned = Setting(model, plan, self.batch_spec, find_groups(model, scan_layers))
        self._strategies, setting = bind_all(scanned, strategies)
        self.plan = setting.plan  # the plan table says which stage holds each pipelined layer
        targets = remat_targets(model, remat_) if remat_ is not None else []
        body_policies, targets = scan_remat(setting.groups, targets, remat_)
        raise_if_any(stack_problems(setting.groups, plan), header="scan_layers cannot stack this plan")
        self.layout = StateLayout(setting.groups)
        self._given = given_optimizer(optimizer, model, plan, self.layout)  # read before the model moves
        self.optimizer, self.transform = self._given.optimizer, self._given.transform
        self._batch = BatchLayout(self.mesh, self.batch_spec)
        self._lock = threading.RLock()
        self._model = self._own(model)
        self._tensors = named_tensors(self._model)
        self._names = split_names(self._model, plan)
        self._replicated = NamedSharding(plan.mesh, PartitionSpec())
        # made by a jitted call: device_put of a one-device key to a multi-process replicated sharding gave an
        # array whose shards cannot be listed, and a checkpoint could not write it
        self._base_key = jax.jit(lambda: jax.random.key_data(jax.random.key(seed)), out_shardings=self._replicated)()
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._stacks: dict[str, StackedArray] = {}
        self._frozen = self._physical(self._names[2])
        self._state = self._initial_state()
        self._views()
        self._given.settle(self._model)
        bound, policy = list(self._strategies.values()), remat_.jax_policy() if remat_ is not None else None
        shardings = shardings_by_key({**self._state.params, **self._frozen})
        runtime = Runtime(
            self._model,
            loss_fn,
            precision,
            shardings,
            setting.groups,
            tuple(targets),
            policy,
            body_policies,
            self._batch,
            tracing_all(bound),
        )
        step = Step(
            runtime, self.transform, grad_accum_steps, self._batch, skip_nonfinite, gradient_of(bound), max_grad_norm
        )
        self._step_fn = Retracing(lambda: self._compile(step, donate))
        self._evaluations = Compiled(runtime)
        self._trained_on: Any = None  # the structure of the batches steps took, which evaluate checks against
        self._start_observing(log_every, trackers, peak_flops)

    def _own(self, model: torch.nn.Module) -> torch.nn.Module:
        """Places ``model``'s tensors as the plan says and makes this Trainer their owner; scanned layers are
        placed when they are stacked, so a pipeline stage's devices receive only its layers."""
        stacked = {name for names in self.layout.stacks().values() for name in names}
        return self._take(shard(model, self.plan, skip=stacked))

    def _take(self, model: torch.nn.Module) -> torch.nn.Module:
        """Makes this Trainer the module's owner; arrays another Trainer may donate are copied first."""
        previous = getattr(model, "_torchshard_trainer", None)
        if previous is not None and previous() is not None:
            tensors = named_tensors(model)
            copies = jax.jit(lambda t: jax.tree.map(jnp.copy, t))({n: unwrap(t) for n, t in tensors.items()})
            rebind(tensors, copies)
        model._torchshard_trainer = weakref.ref(self)  # type: ignore[assignment]
        if self.precision is not None:
            store_params(model, self.plan, self.precision)
        return model

    @property
    def lock(self) -> threading.RLock:
        """Held while a step runs (or anything else reads or rebinds the module's tensors)."""
        return self._lock

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

    def _compile(self, step: Step, donate: bool) -> Callable[..., Any]:
        out = (self.state_shardings(), self._replicated)
        fresh = lambda *args: step(*args)  # noqa: E731  # a new function: JAX traces it anew (Retracing)
        return jax.jit(fresh, donate_argnums=(0,) if donate else (), out_shardings=out)

    def place_batch(self, batch: Any, *, local: bool = False, steps: int | None = None) -> Any:
        """Places every leaf of ``batch`` (torch CPU/torchax tensors, numpy, jax) with ``batch_spec``.

        Args:
            batch: the global batch, the same on every process; or, with ``local``, only this
                process's rows (see `torchshard.distributed.local_batch_slice`).
            local: ``batch`` is this process's slice of the global batch.
            steps: the micro-batches its rows must split into (default: ``grad_accum_steps``; 1 to evaluate).

        Raises:
            ArgumentError: a leaf that is not a tensor or array (e.g. a string), on the meta device,
                or with no rows.
            ShardingError: every leaf whose sharded dims do not divide by the mesh axes.
        """
        leaves = jax.tree.leaves(batch)
        if not local and all(isinstance(x, jax.Array) and x.sharding == self._batch.sharding(x) for x in leaves):
            return batch  # already placed (by place_batch or prefetch): nothing to check or move
        raise_for_arguments(batch_type_problems(leaves), header="invalid batch")
        problems = [p for i, leaf in enumerate(leaves) for p in self._batch_problems(i, leaf, local=local, steps=steps)]
        raise_if_any(problems, header=f"batch does not fit batch_spec {self.batch_spec} on {describe_mesh(self.mesh)}")
        return jax.tree.map(lambda x: put(x, self._batch.sharding(x), process_local=local), batch)

    def _batch_problems(self, index: int, leaf: Any, *, local: bool = False, steps: int | None = None) -> list[str]:
        steps = self.grad_accum_steps if steps is None else steps
        return leaf_problems(self._batch, list(self._strategies.values()), steps, index, leaf, local=local)

    def step(self, batch: Any, *, local: bool = False) -> dict[str, jax.Array]:
        """Runs one training step on ``batch``; returns metrics as unsynchronised jax scalars.

        ``float(metrics["loss"])`` waits for the value; not reading it lets steps overlap,
        up to ``max_in_flight`` queued steps. In a multi-process run the metrics are the same
        on every process. Calls from several threads run one at a time.

        Args:
            batch: a pytree (tensor, tuple, dict...) of torch CPU tensors or placed tensors: by
                default the global batch, the same on every process.
            local: ``batch`` holds only this process's rows of the global batch (each host loads
                its own slice; see `torchshard.distributed.local_batch_slice`).

        Returns:
            ``{"loss": ..., "grad_norm": ..., **aux}`` (and ``"skipped"`` with ``skip_nonfinite``).

        Raises:
            ShardingError: the batch does not fit, ``loss_fn`` returns something other than a loss
                tensor, or another Trainer has since taken over this module.
        """
        started = time.perf_counter()
        with self._lock:
            self._check_owner()
            args = self._step_args(batch, local=local)
            with jax.set_mesh(self.mesh):  # constrain() inside forward reads the mesh it is traced under
                self._state, metrics = self._step_fn(*args)
            self._trained_on = self._trained_on or structure(batch)
            self._bind()
            self._throttle(metrics["loss"])
        self._observe(metrics, args[2], started)  # every log_every steps: logs (and waits for the step)
        heartbeat()  # progress for the launcher's hang watchdog (nothing outside a launched run)
        return metrics

    def _check_owner(self) -> None:
        owner = getattr(self._model, "_torchshard_trainer", None)
        if owner is None or owner() is not self:
            raise ShardingError(
                "another Trainer has been built on this Trainer's module since, and owns its tensors now; "
                "train with the newer Trainer (or deep-copy the module before building a second one)"
            )

    def lower(self, batch: Any) -> jax.stages.Lowered:
        """The step lowered for ``batch``, without running it or donating anything.

        Args:
            batch: as for `step`.

        Returns:
            A ``jax.stages.Lowered``; ``.compile().as_text()`` is the partitioned HLO that `step` runs.

        Examples:
            >>> model = torch.nn.Linear(16, 4)
            >>> p = ts.plan(model, ts.make_mesh({"data": 8}))
            >>> trainer = Trainer(model, lambda m, b: m(b).square().mean(), __import__("optax").sgd(0.1), p)
            >>> hlo = trainer.lower(torch.randn(32, 16)).compile().as_text()
            >>> "all-reduce" in hlo  # data parallel: the gradients are summed over "data"
            True
        """
        with self._lock:
            args = self._step_args(batch)
            with jax.set_mesh(self.mesh):
                return self._step_fn.lower(*args)

    def trace(self, batch: Any) -> jax.stages.Traced:
        """The step traced for ``batch`` (``.jaxpr`` is its program before XLA), as `lower` does without compiling."""
        with self._lock, jax.set_mesh(self.mesh):
            return self._step_fn.trace(*self._step_args(batch))

    def evaluate(self, batch: Any, fn: LossFn | None = None, *, local: bool = False) -> dict[str, jax.Array]:
        """``fn(model, batch)`` on the current state in eval mode, as one compiled call; nothing in the state changes.

        No gradients, nothing donated: step count, RNG key, parameters, buffers and optimizer state
        stay as they are. The model runs in ``eval()`` mode (dropout off, BatchNorm on its running
        statistics), its modes restored after. Compiled once per function and batch shape; the last
        few compiled evaluations are kept.

        Args:
            batch: as for `step` (with ``local``, this process's rows); every option of the Trainer
                applies (a pipeline runs its forward alone; ``grad_accum_steps`` does not split it).
            fn: ``fn(model, batch)`` returning a tensor (reported as ``"output"``) or a dict of
                tensors; by default ``loss_fn``, reported as ``"loss"`` with its metrics.
            local: ``batch`` holds only this process's rows of the global batch.

        Returns:
            name → jax array (unsynchronised, as `step`'s metrics).

        Raises:
            ArgumentError: ``fn`` is not callable or returns something other than tensors; a batch
                whose structure, ranks or kinds of values differ from the batches `step` took.
            ShardingError: the batch does not fit ``batch_spec`` (as for `step`).

        Examples:
            >>> model = torch.nn.Linear(16, 4)
            >>> eager = __import__("copy").deepcopy(model)  # the Trainer moves the model's tensors to the mesh
            >>> p = ts.plan(model, ts.make_mesh({"data": 8}))
            >>> trainer = Trainer(model, lambda m, b: m(b).square().mean(), __import__("optax").sgd(0.1), p)
            >>> x = torch.randn(32, 16)
            >>> abs(float(trainer.evaluate(x)["loss"]) - eager(x).square().mean().item()) < 1e-6
            True
            >>> trainer.evaluate(x, lambda m, b: {"mean": m(b).mean()})["mean"].shape, trainer.step_count
            ((), 0)
        """
        callable_ = fn is None or callable(fn)
        raise_for_arguments(
            [] if callable_ else [f"fn must be a function fn(model, batch), got {fn!r:.40}"],
            header="invalid evaluate arguments",
        )
        with self._lock:
            self._check_owner()
            raise_for_arguments(
                structure_problems(self._trained_on, jax.tree.map(unwrap, batch)),
                header="evaluate: the batch is not like the training batches",
            )
            args = self._step_args(batch, local=local, steps=1)
            with jax.set_mesh(self.mesh), evaluating(self._model):
                return self._evaluations(fn, *args)

    def _step_args(self, batch: Any, *, local: bool = False, steps: int | None = None) -> tuple[Any, ...]:
        placed = self.place_batch(jax.tree.map(unwrap, batch), local=local, steps=steps)
        self._state = self._given.refresh(self._state)  # a torch optimizer's values now: inputs of the step
        return self._state, self._frozen, placed, self._base_key

    def _throttle(self, marker: jax.Array) -> None:
        self._in_flight.append(marker)
        while len(self._in_flight) > self.max_in_flight:
            self._in_flight.popleft().block_until_ready()


reserve(Trainer)  # its own parameters: a strategy keyword among them would never reach the strategy
