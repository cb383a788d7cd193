"""Trainer: forward, backward and the optax update of a sharded torch module as one jitted call."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import optax
import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._base.specs import SpecLike, parse_spec
from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.tensors import unwrap
from torchshard._multihost.worker import heartbeat
from torchshard._sharding.plan import ShardingPlan
from torchshard._strategies import reserve
from torchshard._train.optim.given import GivenOptimizer
from torchshard._train.precision import MixedPrecision
from torchshard._train.remat import RematLike, as_remat
from torchshard._train.scan import ScanLike
from torchshard._train.state import Arrays, TrainState
from torchshard._train.step import LossFn
from torchshard._train.strategy import Bound
from torchshard._trainer import strategic
from torchshard._trainer.assemble import assemble
from torchshard._trainer.batches import place_batch
from torchshard._trainer.checks import check_trainer_args
from torchshard._trainer.core import Core, Options
from torchshard._trainer.evaluate import evaluating, structure, structure_problems
from torchshard._trainer.forward import Forward
from torchshard._trainer.holding import Holding, check_owner
from torchshard._trainer.observed import Observer
from torchshard._trainer.stateful import StateIO
from torchshard._trainer.trackers import Tracker


def _io(trainer: Trainer) -> StateIO:
    return trainer._io


def _observer(trainer: Trainer) -> Observer:
    return trainer._observer


def core_of(trainer: Trainer) -> Core:
    """The state ``trainer``'s parts share: for `AbstractTrainer` and for tests and benchmarks that time its step."""
    return trainer._core


class Trainer:
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

    # how the state is held: placed arrays (`AbstractTrainer`: shapes)
    _holding: ClassVar[Holding] = Holding()

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
        options = Options(
            batch_spec=parse_spec(batch_spec) or PartitionSpec(),
            grad_accum_steps=grad_accum_steps,
            donate=donate,
            seed=seed,
            max_in_flight=max_in_flight,
            precision=precision,
            remat=as_remat(remat),
            scan_layers=scan_layers,
            skip_nonfinite=skip_nonfinite,
            max_grad_norm=max_grad_norm,
        )
        self._core = core = assemble(self, self._holding, model, loss_fn, optimizer, plan, options, strategies)
        self._io = StateIO(core)
        self._observer = observer = Observer(core, log_every, trackers, peak_flops)
        # set once, never changed: read-only copies of what the parts hold (the plan as the strategies laid it out)
        self.precision, self.batch_spec, self.grad_accum_steps = precision, options.batch_spec, grad_accum_steps
        self.max_in_flight, self.plan, self.layout = max_in_flight, core.plan, core.layout
        self.optimizer, self.transform = core.given.optimizer, core.given.transform
        self.log_every, self.trackers, self.peak_flops = log_every, observer.trackers, observer.peak_flops

    @property
    def lock(self) -> threading.RLock:
        """Held while a step runs (or anything else reads or rebinds the module's tensors)."""
        return self._core.lock

    @property
    def mesh(self) -> Mesh:
        """The device mesh the plan places tensors on."""
        return self._core.mesh

    @property
    def model(self) -> torch.nn.Module:
        """The module, bound to the latest parameters and buffers."""
        return self._core.model

    @property
    def state(self) -> TrainState:
        return self._core.state

    @property
    def given_optimizer(self) -> GivenOptimizer:
        """The optimizer as the step applies it: its optax transformation and, for a torch optimizer, its
        translation and each parameter's place in the train state (what torch-format exports read)."""
        return self._core.given

    @property
    def step_count(self) -> int:
        return int(self._core.state.step)

    @property
    def rng_key(self) -> jax.Array:
        """Raw key data (uint32) the per-step keys are folded from: part of a resumable state."""
        return self._core.base_key

    @property
    def strategies(self) -> Mapping[str, Bound]:
        """Trainer keyword → its bound strategy (``.option`` is what the keyword resolved to: e.g.
        ``strategies["expert_dispatch"].option`` is ``ExpertDispatch()`` where all-to-all runs), read-only."""
        return strategic.strategies(self._core)

    @property
    def idle_fraction(self) -> float:
        """The fraction of the devices' time the strategies leave idle: a pipeline's bubble,
        ``(S-1)/(repeats*M + S-1)`` (``2(S-1)/(3M + 2(S-1))`` under ``"zero_bubble"``); 0.0 without one."""
        return strategic.idle_fraction(self._core)

    @property
    def kernels(self) -> dict[str, Any]:
        """The kernel each attention call site got and why (``attention_kernel=``), once the step is traced."""
        return strategic.kernels(self._core)

    @property
    def flops_per_step(self) -> float:
        """Matmul FLOPs one device runs in a step, from the compiled step's HLO with loop trip counts.

        The figure `torchshard.inspect.search` estimates step times from: every ``while`` body
        counted as often as it runs, and forwards that ``remat=`` recomputes counted again. MFU
        counts them once: see `model_flops_per_step`. Read for the batch shape of the latest step.

        Raises:
            ArgumentError: no step has run yet (the step is compiled for a batch).
        """
        return self._observer.flops_per_step

    @property
    def model_flops_per_step(self) -> float:
        """`flops_per_step` with each rematerialised forward counted once: the FLOPs MFU is measured with."""
        return self._observer.model_flops_per_step

    state_shardings = Forward(_io, StateIO.state_shardings)
    physical_arrays = Forward(_io, StateIO.physical_arrays)
    log = Forward(_observer, Observer.log)
    close = Forward(_observer, Observer.close)
    profile = Forward(_observer, Observer.profile)
    save_memory_profile = Forward(_observer, Observer.save_memory_profile)

    def tensor_dtypes(self) -> dict[str, torch.dtype]:
        """The torch dtype each tensor is stored in (the master dtype under `MixedPrecision`)."""
        return self._core.dtypes()

    def load_state(self, state: TrainState, *, rng_key: jax.Array | None = None, frozen: Arrays | None = None) -> None:
        """Replaces the training state (e.g. from a checkpoint); arrays must already be placed.

        A torch optimizer's param groups take the state's hyperparameters (a checkpoint's ``lr``, ``betas``...).

        Args:
            state: the new `TrainState`, sharded as `state_shardings` says.
            rng_key: the `rng_key` to continue from (kept if None).
            frozen: new arrays for frozen (``requires_grad=False``) parameters, by train-state key.
        """
        with self._core.lock:
            self._observer.restart()  # the step count may have changed: read it again
            self._io.load_state(state, rng_key=rng_key, frozen=frozen)

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
        return place_batch(self._core, batch, local=local, steps=steps)

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
        started, core = time.perf_counter(), self._core
        with core.lock:
            check_owner(core.model, self)
            args = self._holding.step_args(core, batch, local=local)
            with jax.set_mesh(core.mesh):  # constrain() inside forward reads the mesh it is traced under
                core.state, metrics = core.step_fn(*args)
            core.trained_on = core.trained_on or structure(batch)
            self._io.bind()
            core.throttle(metrics["loss"])
        self._observer.observe(metrics, args[2], started)  # every log_every steps: logs (and waits for the step)
        heartbeat()  # progress for the launcher's hang watchdog (nothing outside a launched run)
        return metrics

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
        with self._core.lock:
            args = self._holding.step_args(self._core, batch)
            with jax.set_mesh(self.mesh):
                return self._core.step_fn.lower(*args)

    def trace(self, batch: Any) -> jax.stages.Traced:
        """The step traced for ``batch`` (``.jaxpr`` is its program before XLA), as `lower` does without compiling."""
        with self._core.lock, jax.set_mesh(self.mesh):
            return self._core.step_fn.trace(*self._holding.step_args(self._core, batch))

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
        core = self._core
        with core.lock:
            check_owner(core.model, self)
            raise_for_arguments(
                structure_problems(core.trained_on, jax.tree.map(unwrap, batch)),
                header="evaluate: the batch is not like the training batches",
            )
            args = self._holding.step_args(core, batch, local=local, steps=1)
            with jax.set_mesh(core.mesh), evaluating(core.model):
                return core.evaluations(fn, *args)


reserve(Trainer)  # its own parameters: a strategy keyword among them would never reach the strategy
