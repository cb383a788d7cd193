"""The toy's user option: ``Trainer(mark=Mark(tag))``."""

from __future__ import annotations

import dataclasses

MARKS: list[str] = []  # what the execution hook saw, "tag:stack"


@dataclasses.dataclass(frozen=True)
class Mark:
    """Mark the scanned stack: the step's execution hook logs ``tag`` each time it runs the stack."""

    tag: str = "marked"
