"""Preemption: a SIGTERM (or the platform's notice) seen by any process becomes True on every process at one step."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
import numpy as np

_state: dict[str, Any] = {"installed": False, "agreed": False, "previous": signal.SIG_DFL}
_signalled = threading.Event()


def _on_sigterm(signum: int, _frame: object) -> None:
    """The first SIGTERM asks the loop to save and stop; a second one is handled as before the first call."""
    if not _signalled.is_set():
        _signalled.set()
        return
    signal.signal(signal.SIGTERM, _state["previous"])
    _state["installed"] = False
    os.kill(os.getpid(), signum)


def _install() -> None:
    """Catches SIGTERM from now on (the first call: a handler installed on import would change global state).

    Python's handler replaces JAX's preemption notifier's: the flag below is agreed on instead. A
    second SIGTERM goes to the handler that was there before (by default: the process ends).
    Signal handlers can only be installed from the main thread; elsewhere the platform's notice
    (`reached_preemption_sync_point`) is all there is.
    """
    if not _state["installed"] and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        _state["previous"] = signal.SIG_DFL if previous is None else previous  # None: set outside Python
        _state["installed"] = True


def _platform_notice(step: int) -> bool:
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError:  # jax.distributed started without its preemption service
        return False


def preempted_at(step: int) -> bool:
    """Whether any process got SIGTERM (or a preemption notice); the same answer on every process.

    Every process must call it at the same point of its loop with the same ``step`` (a tiny
    collective: the max of one flag per process). Once True it stays True.
    """
    _install()
    if _state["agreed"]:
        return True
    flag = _signalled.is_set()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flag = bool(np.max(multihost_utils.process_allgather(np.int32(flag)))) or _platform_notice(step)
    _state["agreed"] = flag
    return flag
