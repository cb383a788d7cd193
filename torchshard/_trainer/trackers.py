"""Where a Trainer's logged metrics go: the `Tracker` protocol and TensorBoard, W&B, Trackio and JSONL trackers."""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torchshard._base.validate import raise_for_arguments


@runtime_checkable
class Tracker(Protocol):
    """What ``Trainer(trackers=[...])`` writes to: two methods, so a tracker of your own is a few lines.

    The Trainer calls ``log`` on the main process only (``jax.process_index() == 0``), every
    ``log_every`` steps and for each `Trainer.log`, and ``close`` from `Trainer.close`. One that
    raises does not stop the others: after all were called, the first failure is a `TrackerError`
    saying the step was applied (and carrying its metrics).

    Examples:
        >>> class Printed:
        ...     def log(self, step, metrics):
        ...         print(step, {k: round(v, 2) for k, v in metrics.items()})
        ...     def close(self):
        ...         pass
        >>> isinstance(Printed(), Tracker)
        True
    """

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Records ``metrics`` (name → number) for training step ``step``."""

    def close(self) -> None:
        """Flushes and releases what the tracker holds; nothing is logged after."""


def path_problem(path: Any, *, what: str, directory: bool) -> str | None:
    """Why ``path`` cannot be written (a file, or a directory with ``directory``), or None.

    The nearest existing ancestor must be a writable directory; ``path`` itself, if it exists,
    must be the right kind. Nothing is created.

    Examples:
        >>> path_problem("/proc/version/logs", what="logdir", directory=True)
        "logdir '/proc/version/logs' cannot be created: '/proc/version' is a file, not a directory"
    """
    if not isinstance(path, str | os.PathLike):
        return f"{what} must be a path (str or pathlib.Path), got {type(path).__name__}"
    target = Path(path)
    if target.exists() and target.is_dir() != directory:
        return f"{what} {str(target)!r} exists and is {'a file' if directory else 'a directory'}; choose another path"
    ancestor = target if target.is_dir() else target.parent  # an existing file is appended to: its folder counts
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{what} {str(target)!r} cannot be created: {str(ancestor)!r} is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{what} {str(target)!r} cannot be written: {str(ancestor)!r} is not writable by this user"
    return None


def _check_path(path: Any, *, what: str, directory: bool) -> Path:
    problem = path_problem(path, what=what, directory=directory)
    raise_for_arguments([problem] if problem else [], header=f"invalid {what}")
    return Path(path)


def _library(module: str, extra: str, tracker: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f'ts.track.{tracker} needs the {module} package: pip install "torchshard[{extra}]"') from err


def keyword_problems(function: Callable[..., Any], kwargs: Mapping[str, Any], *, what: str) -> list[str]:
    """The keywords ``function`` (e.g. ``wandb.init``) does not take, each with its nearest name: nothing is called.

    Examples:
        >>> def init(project=None, name=None): ...
        >>> keyword_problems(init, {"projekt": "x"}, what="wandb.init")
        ["wandb.init() takes no keyword 'projekt'; did you mean 'project'?"]
    """
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read (a C function): the library checks them itself
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    named = [n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = []
    for key in kwargs:
        if key not in named:
            near = difflib.get_close_matches(key, named, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"its keywords: {', '.join(named)}"
            problems.append(f"{what}() takes no keyword {key!r}; {hint}")
    return problems


class JSONL:
    """One JSON object per logged step, appended to ``path`` and flushed: ``{"step": 10, "loss": 2.31, ...}``.

    Args:
        path: the file; its directory is made on the first write, lines are appended to what it holds.

    Raises:
        ArgumentError: ``path`` is a directory or cannot be created.

    Examples:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
        >>> tracker = JSONL(path)
        >>> tracker.log(10, {"loss": 2.5})
        >>> tracker.close()
        >>> path.read_text()
        '{"step": 10, "loss": 2.5}\\n'
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = _check_path(path, what="JSONL path", directory=False)

    def __repr__(self) -> str:
        return f"ts.track.JSONL({str(self.path)!r})"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Appends one line; a write that fails (a full disk) leaves the file as it was and raises ``OSError``."""
        line = (json.dumps({"step": step, **metrics}) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        # opened per line (every log_every steps): a line is on disk as soon as it is logged, nothing is held open
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            _write_all(fd, line, undo=lambda: os.unlink(self.path) if created else os.ftruncate(fd, start))
        except OSError as err:  # named with the file: os.write's errors name none
            raise OSError(
                err.errno, f"{err.strerror}; the line of step {step} was not written", str(self.path)
            ) from err
        finally:
            os.close(fd)

    def close(self) -> None:
        """Nothing to release: each line is written and closed as it is logged."""


def _write_all(fd: int, data: bytes, *, undo: Callable[[], object]) -> None:
    """Writes every byte of ``data`` to ``fd``; on failure ``undo`` runs first, so no half line is left for a reader."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        undo()
        raise


class TensorBoard:
    """Scalars in TensorBoard event files under ``logdir`` (``tensorboard --logdir DIR``), one tag per metric.

    Writes through ``torch.utils.tensorboard`` (or tensorboardX); the writer opens on the first
    log, so processes that never log (not the main one) make no files.

    Args:
        logdir: the run's directory.

    Raises:
        ImportError: neither tensorboard nor tensorboardX is installed (``pip install "torchshard[tensorboard]"``).
        ArgumentError: ``logdir`` is a file or cannot be created.

    Examples:
        >>> import tempfile
        >>> tracker = TensorBoard(tempfile.mkdtemp())
        >>> tracker.log(1, {"loss": 2.5})
        >>> tracker.close()
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = _check_path(logdir, what="TensorBoard logdir", directory=True)
        try:
            self._writer_class = importlib.import_module("torch.utils.tensorboard").SummaryWriter
        except ImportError:
            self._writer_class = _library("tensorboardX", "tensorboard", "TensorBoard").SummaryWriter
        self._writer: Any = None

    def __repr__(self) -> str:
        return f"ts.track.TensorBoard({str(self.logdir)!r})"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            self._writer = self._writer_class(str(self.logdir))
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()  # logged every N steps: readable now, not only after close

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandB:
    """A Weights & Biases run: ``wandb.init(**init_kwargs)`` on the first log, ``run.log(metrics, step=step)``.

    Offline runs (``WANDB_MODE=offline`` or ``mode="offline"``) write under ``dir``; ``wandb sync``
    uploads them later.

    Args:
        **init_kwargs: passed to ``wandb.init`` (``project``, ``name``, ``config``, ``dir``, ``mode``...).

    Raises:
        ImportError: wandb is not installed (``pip install "torchshard[wandb]"``).
        ArgumentError: a keyword ``wandb.init`` does not take (checked against its signature; no run starts).
    """

    def __init__(self, **init_kwargs: Any) -> None:
        self._wandb = _library("wandb", "wandb", "WandB")
        self.init_kwargs = init_kwargs
        self._run: Any = None
        raise_for_arguments(self.problems(), header="invalid ts.track.WandB arguments")

    def __repr__(self) -> str:
        return f"ts.track.WandB({', '.join(f'{k}={v!r:.40}' for k, v in self.init_kwargs.items())})"

    def problems(self) -> list[str]:
        """The keywords ``wandb.init`` would refuse (what `Trainer` checks when it is built)."""
        return keyword_problems(self._wandb.init, self.init_kwargs, what="wandb.init")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._run is None:
            self._run = self._wandb.init(**self.init_kwargs)
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class Trackio:
    """A Trackio run (Hugging Face's local-first tracker): ``trackio.init(**init_kwargs)`` on the first log.

    Args:
        **init_kwargs: passed to ``trackio.init`` (``project``, ``name``, ``config``, ``space_id``...).

    Raises:
        ImportError: trackio is not installed (``pip install "torchshard[trackio]"``).
        ArgumentError: a keyword ``trackio.init`` does not take (checked against its signature; no run starts).
    """

    def __init__(self, **init_kwargs: Any) -> None:
        self._trackio = _library("trackio", "trackio", "Trackio")
        self.init_kwargs = init_kwargs
        self._started = False
        raise_for_arguments(self.problems(), header="invalid ts.track.Trackio arguments")

    def __repr__(self) -> str:
        return f"ts.track.Trackio({', '.join(f'{k}={v!r:.40}' for k, v in self.init_kwargs.items())})"

    def problems(self) -> list[str]:
        """The keywords ``trackio.init`` would refuse (what `Trainer` checks when it is built)."""
        return keyword_problems(self._trackio.init, self.init_kwargs, what="trackio.init")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self._started:
            self._trackio.init(**self.init_kwargs)
            self._started = True
        self._trackio.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._started:
            self._trackio.finish()
            self._started = False


def tracker_problems(trackers: Any) -> list[str]:
    """What is wrong with ``Trainer(trackers=...)``: a sequence of objects with ``log`` and ``close`` methods."""
    if isinstance(trackers, str) or not isinstance(trackers, Sequence):
        hint = " (wrap one tracker in a list)" if isinstance(trackers, Tracker) else ""
        return [f"trackers must be a list of trackers such as ts.track.JSONL(path), got {trackers!r:.60}{hint}"]
    problems = [
        f"trackers[{i}] is {tracker!r:.60}, which has no log(step, metrics) and close() methods; pass e.g. "
        f"ts.track.TensorBoard(logdir), ts.track.WandB(project=...), ts.track.JSONL(path), or your own object "
        f"with those two methods"
        for i, tracker in enumerate(trackers)
        if not (callable(getattr(tracker, "log", None)) and callable(getattr(tracker, "close", None)))
    ]
    # their keywords again, as they stand now: a run that would fail at the first logged step fails here
    return problems + [
        f"trackers[{i}]: {p}" for i, t in enumerate(trackers) if isinstance(t, WandB | Trackio) for p in t.problems()
    ]
