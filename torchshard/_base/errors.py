"""Errors and warnings raised by torchshard."""

from __future__ import annotations

from collections.abc import Sequence


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
