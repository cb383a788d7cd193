"""What a Trainer shows of its run: a step line and trackers every ``log_every`` steps, FLOPs, MFU, memory, profiles."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from torchshard._base.errors import ArgumentError, CheckpointError
from torchshard._base.validate import raise_for_arguments
from torchshard._trainer.core import Core
from torchshard._trainer.run_metrics import StepFigures, batch_counts, device_memory, host_rss, peak_flops, step_line
from torchshard._trainer.tracked import close_all, log_all, metric_values
from torchshard._trainer.trackers import Tracker, path_problem

logger = logging.getLogger("torchshard")

Signature = tuple[Any, tuple[tuple[Any, Any, Any], ...]]  # the batch's treedef, and each leaf's shape, dtype, sharding


@dataclasses.dataclass
class _Window:
    """The steps since the last read: where they started (step count, time), where they are, what they processed."""

    start: int
    time: float
    step: int
    tokens: int = 0
    samples: int = 0


class Observer:
    """A Trainer's run metrics, trackers and profiles, read from its shared state.

    Args:
        core: the Trainer's shared state.
        log_every: every N steps, a step line on logger ``torchshard`` and every tracker (None: never).
        trackers: what `emit` gives the values to.
        peak: FLOP/s per device for MFU (None: the device's hardware profile).
    """

    def __init__(self, core: Core, log_every: int | None, trackers: Sequence[Tracker], peak: float | None) -> None:
        self.core = core
        self.log_every = log_every
        self.trackers: tuple[Tracker, ...] = tuple(trackers)
        self._main = jax.process_index() == 0
        self._window: _Window | None = None  # None: the step count is read (a sync) at the next step
        self._signature: Signature | None = None
        self._figures: dict[Signature, StepFigures] = {}
        precision = core.options.precision
        low = precision is not None and precision.compute_dtype.itemsize <= 2
        low = low or all(d.itemsize <= 2 for d in core.dtypes().values() if d.is_floating_point)
        self.peak_flops = peak if peak is not None else peak_flops(core.mesh.devices.flat[0], low_precision=low)

    def restart(self) -> None:
        """The step count may have changed (`load_state`): the next step reads it again before logging."""
        self._window = None

    @property
    def flops_per_step(self) -> float:
        """Matmul FLOPs one device runs in a step (`Trainer.flops_per_step`)."""
        return self._step_figures().flops

    @property
    def model_flops_per_step(self) -> float:
        """`flops_per_step` with each rematerialised forward counted once (`Trainer.model_flops_per_step`)."""
        return self._step_figures().model_flops

    def _step_figures(self) -> StepFigures:
        if self._signature is None:
            raise ArgumentError(
                "the step's FLOPs are read from the step compiled for a batch: run trainer.step(batch) first "
                "(or count an unrun step with ts.inspect.AbstractTrainer and trainer.lower(batch))"
            )
        if self._signature not in self._figures:
            self._figures[self._signature] = StepFigures.of(self._lower_signature(self._signature).compile())
        return self._figures[self._signature]

    def _lower_signature(self, signature: Signature) -> jax.stages.Lowered:
        treedef, leaves = signature
        structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, sharding in leaves]
        core = self.core
        with core.lock, jax.set_mesh(core.mesh):
            return core.step_fn.lower(core.state, core.frozen, jax.tree.unflatten(treedef, structs), core.base_key)

    def observe(self, metrics: Mapping[str, jax.Array], placed: Any, started: float) -> None:
        """After each step: remembers its batch's shapes and, every ``log_every`` steps, logs (the only sync)."""
        leaves, treedef = jax.tree.flatten(placed)
        self._signature = (treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        every = self.log_every
        if every is None or not self._main:
            return
        if self._window is None:
            self._first_step(metrics, leaves, started, every)
            return
        window = self._window
        tokens, samples = batch_counts(leaves)
        window.step, window.tokens, window.samples = window.step + 1, window.tokens + tokens, window.samples + samples
        if window.step % every == 0:
            values = self._values(metrics)  # waits for this step: the one read per log_every steps
            now = time.perf_counter()
            values |= self._rates(now - window.time, window)
            self._window = _Window(window.step, now, window.step)  # before the trackers, which may raise
            self._emit(window.step, values)

    def _first_step(self, metrics: Mapping[str, jax.Array], leaves: list[Any], started: float, every: int) -> None:
        """The first step logged from (or the first after `load_state`): reads where the count stands."""
        step = int(self.core.state.step)  # waits for the step
        elapsed = time.perf_counter() - started
        self._step_figures()  # the step is compiled: its HLO is read now, outside the next window's time
        self._window = _Window(step, time.perf_counter(), step)  # before the trackers, which may raise
        if step % every == 0:  # its time includes compiling it
            window = _Window(step - 1, started, step, *batch_counts(leaves))
            self._emit(step, {**self._values(metrics), **self._rates(elapsed, window)})

    def _values(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        return {name: float(value) for name, value in metrics.items()}

    def _rates(self, elapsed: float, window: _Window) -> dict[str, float]:
        """Throughput, FLOP rates and memory of the steps of ``window``, which took ``elapsed`` seconds."""
        step_time = elapsed / (window.step - window.start)
        figures = self._step_figures()
        rates = {"step_time_s": step_time, "samples_per_s": window.samples / elapsed}
        if window.tokens:
            rates["tokens_per_s"] = window.tokens / elapsed
        rates["tflops_per_device"] = figures.model_flops / step_time / 1e12
        if self.peak_flops is not None:
            rates["mfu"] = figures.model_flops / step_time / self.peak_flops
        rates["recompute_ratio"] = figures.recompute_ratio
        mine = [d for d in self.core.mesh.devices.flat if d.process_index == jax.process_index()]
        rates |= device_memory(mine) or {"memory_peak_bytes": float(figures.memory.peak_bytes)}
        rates["host_rss_bytes"] = host_rss()
        return rates

    def _emit(self, step: int, values: Mapping[str, float]) -> None:
        """One line on the logger, then every tracker; a failing tracker is a `TrackerError` (the step was applied)."""
        logger.info(step_line(step, values))
        log_all(self.trackers, step, values)

    def log(self, metrics: Mapping[str, Any], *, prefix: str = "") -> dict[str, float]:
        """Logs ``metrics`` (e.g. `evaluate`'s) at the current step: one line on logger ``torchshard`` and each tracker.

        Args:
            metrics: name → scalar (jax arrays, tensors or numbers); reading them waits for them.
            prefix: put before each name (``"eval/"`` keeps evaluation apart from training's ``loss``).

        Returns:
            The values logged, as floats (on every process; only the main one writes them).

        Raises:
            ArgumentError: ``metrics`` is not a dict of names to single numbers (a string, a tensor of
                several values), or ``prefix`` is not a string; every culprit named, nothing logged.
            TrackerError: a tracker failed (after every tracker was called); nothing of the
                training state changed.

        Examples:
            >>> model = torch.nn.Linear(4, 1)
            >>> p = ts.plan(model, ts.make_mesh({"data": 8}))
            >>> trainer = ts.Trainer(model, lambda m, b: m(b).square().mean(), __import__("optax").sgd(0.1), p)
            >>> sorted(trainer.log(trainer.evaluate(torch.ones(8, 4)), prefix="eval/"))
            ['eval/loss']
        """
        values = metric_values(metrics, prefix)
        if self._main:
            self._emit(int(self.core.state.step), values)
        return values

    def close(self) -> None:
        """Closes every tracker (flushing what they hold); call it when training ends.

        Raises:
            TrackerError: a tracker's ``close`` raised: the first such, after every tracker was closed.
        """
        close_all(self.trackers, int(self.core.state.step))

    @contextlib.contextmanager
    def profile(self, logdir: str | os.PathLike[str]) -> Iterator[None]:
        """A ``jax.profiler`` trace of the steps run inside the block, written under ``logdir``.

        TensorBoard's profile plugin (``tensorboard --logdir DIR``) and xprof open it. Module calls
        are traced under ``jax.named_scope`` of their names (``model.layers.3.self_attn``), so the
        trace's XLA ops name the layers they belong to. Steps queued before the block are waited
        for first, and those inside before the trace ends, so it holds exactly the block's steps.

        Args:
            logdir: directory for the trace (``plugins/profile/<run>/*.xplane.pb``).

        Raises:
            ArgumentError: ``logdir`` cannot be written, or a ``jax.profiler`` trace is already running
                (profiles do not nest: one trace per process); raised before anything is traced.

        Examples:
            >>> import tempfile
            >>> model = torch.nn.Linear(4, 1)
            >>> p = ts.plan(model, ts.make_mesh({"data": 8}))
            >>> trainer = ts.Trainer(model, lambda m, b: m(b).square().mean(), __import__("optax").sgd(0.1), p)
            >>> with trainer.profile(tempfile.mkdtemp()):
            ...     _ = trainer.step(torch.ones(8, 4))
        """
        problem = path_problem(logdir, what="profile logdir", directory=True)
        raise_for_arguments([problem] if problem else [], header="invalid profile logdir")
        self.core.drain()
        try:
            jax.profiler.start_trace(str(logdir))
        except RuntimeError as err:  # JAX's "Profile has already been started"
            raise ArgumentError(
                f"trainer.profile({str(logdir)!r}): a jax.profiler trace is already running in this process ({err}); "
                f"profiles do not nest: end the outer `with trainer.profile(...)` block (or jax.profiler.stop_trace()) "
                f"first"
            ) from err
        try:
            yield
        finally:
            self.core.drain()
            jax.profiler.stop_trace()

    def save_memory_profile(self, path: str | os.PathLike[str]) -> None:
        """Writes the devices' live buffers now as a pprof profile (``jax.profiler.save_device_memory_profile``).

        Open it with ``pprof --web path`` (or https://pprof.me): which arrays hold device memory, by
        the Python line that made them.

        Raises:
            ArgumentError: ``path`` cannot be written.
            CheckpointError: the write failed (a full disk...), as a save's does; nothing is left
                behind (no partial file, and no folder it made).
        """
        problem = path_problem(path, what="memory profile path", directory=False)
        raise_for_arguments([problem] if problem else [], header="invalid memory profile path")
        _write_new(Path(path), jax.profiler.device_memory_profile(), what="memory profile")


def _write_new(path: Path, data: bytes, *, what: str) -> None:
    """Writes ``path`` whole or not at all: through a hidden file renamed into place; a failure removes what it made.

    Raises:
        CheckpointError: the write failed, naming ``path`` and the fix.
    """
    made = [p for p in [path.parent, *path.parent.parents] if not p.exists()]  # the deepest first
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(data)
        os.replace(part, path)
    except OSError as err:
        part.unlink(missing_ok=True)
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        full = err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        fix = "free space or pass a path on another disk" if full else "pass a path you may write to"
        raise CheckpointError(
            f"{what} {str(path)!r} could not be written ({err.strerror or err}); nothing was left behind: {fix}"
        ) from err
