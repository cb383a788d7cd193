"""Errors and warnings raised by torchshard."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class ShardingError(ValueError):
    """A sharding request that cannot be honoured; lists every problem found, each with its fix."""

    def __init__(self, problems: str | Sequence[str], *, header: str | None = None) -> None:
        self.problems = (problems,) if isinstance(problems, str) else tuple(problems)
        if len(self.problems) == 1 and header is None:
            message = self.problems[0]
        else:
            head = header or f"{len(self.problems)} sharding problems"
            message = head + ":\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class CheckpointError(ShardingError):
    """A checkpoint that cannot be written or read: missing, incomplete, truncated, corrupted or unwritable."""


class ArgumentError(ShardingError, TypeError):
    """Arguments of a public function that are of the wrong type or value; lists every one, each with its fix.

    It is both a `ShardingError` (so a ``ValueError``) and a ``TypeError``: catch whichever your code expects.
    """


class UnusedRuleWarning(UserWarning):
    """A sharding rule matched no tensor of the model (usually a typo in its pattern)."""


def raise_if_any(problems: Sequence[str], *, header: str, error: type[ShardingError] = ShardingError) -> None:
    """Raises one ``error`` listing every problem, or returns if there are none.

    Examples:
        >>> raise_if_any([], header="nothing wrong")
        >>> raise_if_any(["a is bad; use b"], header="bad input")
        Traceback (most recent call last):
        ...
        torchshard._base.errors.ShardingError: bad input (1 problem):
          - a is bad; use b
    """
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise error(problems, header=f"{header} ({count})")


class TrackerError(RuntimeError):
    """A tracker that failed after a training step was applied: names the tracker, the step and what it was given.

    The step it reports was applied (parameters, optimizer state and step count moved on), so running
    it again would apply it twice: continue from the next step. The other trackers were given the
    metrics (or closed) all the same.

    Attributes:
        tracker: the tracker that raised (its exception is this error's ``__cause__``).
        step: the Trainer's step count when it failed: that step was applied.
        metrics: the values it was given (name → float); empty when ``close()`` failed.

    Examples:
        >>> err = TrackerError("JSONL failed", tracker="jsonl", step=3, metrics={"loss": 0.5})
        >>> err.step, err.metrics
        (3, {'loss': 0.5})
    """

    def __init__(self, message: str, *, tracker: object, step: int, metrics: Mapping[str, float]) -> None:
        super().__init__(message)
        self.tracker, self.step, self.metrics = tracker, step, dict(metrics)

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only fields: pickled (e.g. between processes) by hand
        return _tracker_error, (str(self), self.tracker, self.step, self.metrics)


def _tracker_error(message: str, tracker: object, step: int, metrics: Mapping[str, float]) -> TrackerError:
    return TrackerError(message, tracker=tracker, step=step, metrics=metrics)
