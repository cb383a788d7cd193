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


class UnusedRuleWarning(UserWarning):
    """A sharding rule matched no tensor of the model (usually a typo in its pattern)."""


def raise_if_any(problems: Sequence[str], *, header: str) -> None:
    """Raises one `ShardingError` with every problem, or returns if there are none."""
    if problems:
        raise ShardingError(problems, header=f"{header} ({len(problems)} problem{'s' if len(problems) > 1 else ''})")
