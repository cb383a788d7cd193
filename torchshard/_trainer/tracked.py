"""A Trainer's trackers together: metrics checked before any is written, every tracker called, one TrackerError."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from torchshard._base.errors import TrackerError
from torchshard._base.validate import raise_for_arguments
from torchshard._trainer.trackers import Tracker


def _value(name: str, value: Any) -> float | str:
    """``value`` as a float, or why it is no number a tracker can log."""
    if isinstance(value, str | bytes):
        return f"metric {name!r} is a {type(value).__name__} ({value!r:.40}); trackers log numbers: drop it or pass one"
    shape = getattr(value, "shape", None)
    if shape is not None and int(np.prod(shape)) != 1:
        return f"metric {name!r} has shape {tuple(shape)}, not one value; log a scalar, e.g. its mean or one element"
    try:
        return float(value.reshape(()) if shape else value)  # one value of any rank (JAX floats only rank 0)
    except (TypeError, ValueError) as err:
        return f"metric {name!r} is a {type(value).__name__} ({value!r:.40}), not a number ({err})"


def metric_values(metrics: Any, prefix: Any) -> dict[str, float]:
    """``metrics`` as ``{prefix + name: float}``, every bad name and value named first (`Trainer.log`'s check).

    Raises:
        ArgumentError: ``metrics`` is no mapping, a name is no string, a value is no single number,
            or ``prefix`` is no string (all listed; nothing is logged).

    Examples:
        >>> metric_values({"loss": np.float32(0.5)}, "eval/")
        {'eval/loss': 0.5}
    """
    problems = [] if isinstance(prefix, str) else [f"prefix={prefix!r} must be a string such as 'eval/'"]
    if not isinstance(metrics, Mapping):
        problems.append(f"metrics must be a dict name → number, got {type(metrics).__name__} ({metrics!r:.40})")
        metrics = {}
    values = {name: _value(str(name), value) for name, value in metrics.items()}
    problems += [
        f"metric name {k!r} is a {type(k).__name__}; names are strings" for k in metrics if not isinstance(k, str)
    ]
    problems += [v for v in values.values() if isinstance(v, str)]
    raise_for_arguments(problems, header="invalid Trainer.log arguments")
    return {prefix + name: float(value) for name, value in values.items()}


def log_all(trackers: Sequence[Tracker], step: int, values: Mapping[str, float]) -> None:
    """Gives ``values`` to every tracker; the first one that raised becomes a `TrackerError` after all were called.

    Raises:
        TrackerError: a tracker's ``log`` raised; it names the tracker and says that step ``step`` was
            applied, carries ``values``, and has the tracker's exception as ``__cause__``.
    """
    failed = [(t, e) for t, e in ((t, _called(t.log, step, values)) for t in trackers) if e is not None]
    if failed:
        tracker, err = failed[0]
        raise TrackerError(
            f"tracker {tracker!r:.120} failed to log step {step} ({type(err).__name__}: {err}); step {step} was "
            f"applied: do not run it again (its metrics are this error's .metrics{_others(failed, trackers)}). "
            f"Fix the tracker (e.g. free disk space), or leave it out of trackers=",
            tracker=tracker,
            step=step,
            metrics=values,
        ) from err


def close_all(trackers: Sequence[Tracker], step: int) -> None:
    """Closes every tracker, then raises the first failure as a `TrackerError`.

    Raises:
        TrackerError: a tracker's ``close`` raised (after every other tracker was closed).
    """
    failed = [(t, e) for t, e in ((t, _called(t.close)) for t in trackers) if e is not None]
    if failed:
        tracker, err = failed[0]
        raise TrackerError(
            f"tracker {tracker!r:.120} failed to close ({type(err).__name__}: {err}) at step {step}; step {step} was "
            f"applied, and every other tracker was closed{_others(failed, trackers, closing=True)}; release what it "
            f"holds yourself (e.g. finish its run)",
            tracker=tracker,
            step=step,
            metrics={},
        ) from err


def _called(method: Any, *args: Any) -> Exception | None:
    try:
        method(*args)
    except Exception as err:  # the others are still called; KeyboardInterrupt and SystemExit go through
        return err
    return None


def _others(failed: list[tuple[Tracker, Exception]], trackers: Sequence[Tracker], *, closing: bool = False) -> str:
    if len(failed) == 1:
        return "" if closing or len(trackers) == 1 else "; every other tracker logged them"
    rest = ", ".join(f"{t!r:.60} ({type(e).__name__}: {e})" for t, e in failed[1:])
    return f"; {len(failed) - 1} more of the {len(trackers)} trackers failed too: {rest}"
