"""Every process, together: the primary writes the shared files, and one process's failure stops them all."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from torchshard._base.errors import CheckpointError
from torchshard._multihost.agree import flagged_processes


def primary() -> bool:
    """Whether this process writes the files every process shares."""
    return jax.process_index() == 0


def together[T](name: str, work: Callable[[], T]) -> T:
    """Runs ``work`` on every process, then every process raises if any process's ``work`` raised.

    A process that raised alone would leave the others waiting at the next barrier for ever: so a
    failure (a `CheckpointError`) is held until every process has reported in at ``name``, the
    failed process raises its own error and every other one a `CheckpointError` naming it. The
    processes meet at the coordination service, not at a device collective, so this is safe on a
    background save's thread too.
    """
    failure: CheckpointError | None = None
    result: Any = None
    try:
        result = work()
    except CheckpointError as e:
        failure = e
    failed = flagged_processes(name, failure is not None)
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(
            f"process(es) {failed} failed at {name} (their own errors say why); this process stopped with them, so no "
            f"process waits for the others; earlier steps are intact"
        )
    return result
