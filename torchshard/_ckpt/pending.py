"""Saves that write in the background: one at a time, waited for by later saves, loads, listings and exit."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

_THREAD = "torchshard-save"
_NICENESS = 10  # added to the save thread's (and the threads it starts): the training step goes first
logger = logging.getLogger(__name__)


class _Pending:
    """The latest background save, and whether a later save has raised its error yet."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.future: concurrent.futures.Future[Any] | None = None
        self.raised = False  # its error has been raised by a later save (the Future raises it as well)


_pending = _Pending()


def submit(work: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """Runs ``work`` on the save thread; its Future becomes the pending save."""
    with _pending.lock:
        if _pending.executor is None:
            _pending.executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=_THREAD, initializer=_yield_to_training
            )
            # at exit, wait before concurrent.futures stops taking work (orbax's writes use executors)
            # and before atexit handlers stop JAX: threading's exit hooks run first, newest first
            threading._register_atexit(_at_exit)  # type: ignore[attr-defined]
        future = _pending.executor.submit(work)
        _pending.future, _pending.raised = future, False
    return future


def _yield_to_training() -> None:
    """Lowers the save thread's CPU priority: where the host's cores also run the step (CPU devices, the input
    pipeline), a background write must not slow it down. Linux sets it per thread; elsewhere it is a no-op."""
    with contextlib.suppress(AttributeError, OSError):
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + _NICENESS)


def _on_save_thread() -> bool:
    return threading.current_thread().name.startswith(_THREAD)


def wait() -> None:
    """Waits until the pending save (if any) has finished, whether it succeeded or not."""
    future = _pending.future
    if future is not None and not _on_save_thread():
        concurrent.futures.wait([future])


def raise_failure() -> None:
    """Waits for the pending save, then raises its error once if it failed (a later save must not hide it)."""
    wait()
    with _pending.lock:
        future = _pending.future
        error = future.exception() if future is not None and not _pending.raised else None
        _pending.raised = True
    if error is not None:
        raise error


def _at_exit() -> None:
    wait()
    future = _pending.future
    if future is not None and not _pending.raised and future.exception() is not None:
        logger.error("a background torchshard.save failed at exit: %s", future.exception())
