"""Saves that write in the background: one at a time, waited for by later saves, loads, listings and exit.

Each save runs on a thread of its own that is not a daemon, so the interpreter waits for it at exit
(after the main thread ends, before `atexit` handlers stop JAX). Nothing a save runs may use a
``concurrent.futures`` pool: those refuse new work once the interpreter begins to exit, while the
save may still be writing; `on_thread` runs its helpers instead.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

_THREAD = "torchshard-save"
_NICENESS = 10  # added to the save thread's (and the threads it starts): the training step goes first
_SAVES = itertools.count()
logger = logging.getLogger(__name__)


class _Pending:
    """The latest background save, and whether a later save has raised its error yet."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.future: concurrent.futures.Future[Any] | None = None
        self.raised = False  # its error has been raised by a later save (the Future raises it as well)


_pending = _Pending()
_hooked = False  # whether _at_exit is registered


def on_thread[T](
    work: Callable[[], T],
    *,
    name: str,
    after: concurrent.futures.Future[Any] | None = None,
    init: Callable[[], None] | None = None,
) -> concurrent.futures.Future[T]:
    """Runs ``work`` on a new non-daemon thread (after ``after`` finished, ``init`` first); its Future.

    Examples:
        >>> on_thread(lambda: 6 * 7, name="example").result()
        42
    """
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if init is not None:
            init()
        if after is not None:
            concurrent.futures.wait([after])
        future.set_running_or_notify_cancel()
        try:
            result = work()
        except BaseException as e:  # as concurrent.futures does: the Future holds whatever the work raised
            future.set_exception(e)
        else:
            future.set_result(result)

    try:
        threading.Thread(target=run, name=name).start()
    except RuntimeError:
        # CPython 3.12.0 and 3.12.1 refuse new threads once the interpreter waits for its non-daemon ones at exit
        # (python/cpython#113964), which is when a background save still running starts its helpers: run it here
        run()
    return future


def submit(work: Callable[[], Any]) -> concurrent.futures.Future[Any]:
    """Runs ``work`` on a save thread once the pending save has finished; its Future becomes the pending save."""
    global _hooked
    with _pending.lock:
        if not _hooked:
            atexit.register(_at_exit)  # registered after JAX's, so it runs before JAX stops
            _hooked = True
        future = on_thread(work, name=f"{_THREAD}_{next(_SAVES)}", after=_pending.future, init=_yield_to_training)
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
