"""A process of a multi-process run that dies of an uncaught exception exits at once, not at its peers' pace.

Python's exit runs JAX's ``atexit`` clean-up, whose ``jax.distributed.shutdown()`` waits at a barrier
for every process of the run. Peers that are still training (or already dead) never get there, so a
failed process sat in it until its launcher gave up on it: under ``torchrun`` that is 30 seconds
of ``SIGTERM`` (JAX's preemption notifier catches it) before a ``SIGKILL``, on every restart. Once an
exception has reached the top of the main thread, this module ends the process right after the
``atexit`` handlers registered after `install` (a tracker's final flush, say) and logging's flush.
``python -m torchshard.launch`` ends its failed workers the same way (`worker._exit_now`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from types import TracebackType
from typing import Any

# a KeyboardInterrupt ends a plain Python process with the shell's code for SIGINT
_INTERRUPTED, _FAILED = 130, 1
_state: dict[str, Any] = {"installed": False, "code": None}


def _note(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    _state["code"] = _INTERRUPTED if issubclass(kind, KeyboardInterrupt) else _FAILED
    _state["previous"](kind, value, tb)  # the traceback is printed as before


def _end_if_failed() -> None:
    """At exit, before JAX's clean-up: a failed process skips the shutdown barrier."""
    if _state["code"] is None:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_state["code"])


def install() -> None:
    """Makes an uncaught exception end this process without waiting for the run's other processes.

    Called once this process has joined a multi-process run (`runtime.initialize`); later calls
    do nothing. A user's own ``sys.excepthook`` still runs (it is chained), and so do the
    ``atexit`` handlers registered after this call; a normal exit is untouched.

    Examples:
        >>> from torchshard._multihost import failfast
        >>> failfast._end_if_failed()  # nothing failed: returns, and the exit goes on as usual
    """
    if _state["installed"]:
        return
    _state.update(installed=True, previous=sys.excepthook)
    sys.excepthook = _note
    atexit.register(_end_if_failed)  # atexit runs last-in first-out: before JAX's clean-up, registered on import
