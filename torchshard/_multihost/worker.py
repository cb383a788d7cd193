"""Child side of ``torchshard.launch``: join the process group, then run the user's script as ``__main__``.

The launcher runs this file by path (`COMMAND`), not as ``-m torchshard._multihost.worker``: importing the
torchshard package (JAX, torch) takes seconds, and the hang watchdog's stack dumps and progress
signals must be in place before it. So this module imports only the standard library at the top.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.abc
import os
import runpy
import signal
import sys
import threading
import time
import traceback

HEARTBEAT_ENV = "TORCHSHARD_HEARTBEAT"  # the file whose mtime this process's heartbeats move
STACKS_SIGNAL = signal.SIGUSR1  # on it, this process prints every thread's Python stack
_HEARTBEAT_EVERY_S = 0.5
_last_beat = 0.0


def command(script_and_args: list[str]) -> list[str]:
    """The command line that runs this file (by path) for ``script_and_args``."""
    run = f"import runpy; runpy.run_path({os.path.abspath(__file__)!r}, run_name='__main__')"
    return [sys.executable, "-c", run, *script_and_args]


def heartbeat() -> None:
    """Tells ``python -m torchshard.launch`` that this process is making progress.

    The launcher's ``--hang-timeout`` counts a process's output lines and these heartbeats as
    progress (and the main thread's import of a new module). Call it from the training loop
    itself (e.g. once per step), never from a thread of its own: a thread keeps beating while
    the loop is stuck, which would hide the hang. It costs one ``utime`` at most every half
    second, and nothing outside a launched run.

    Examples:
        >>> heartbeat()  # outside a launched run: does nothing
    """
    global _last_beat
    path = os.environ.get(HEARTBEAT_ENV)
    now = time.monotonic()
    if path and now - _last_beat >= _HEARTBEAT_EVERY_S:
        _last_beat = now
        with contextlib.suppress(OSError):
            os.utime(path)


def _exit_now(code: int) -> None:
    # a failed process must not wait in jax.distributed's shutdown barrier for peers that
    # may never get there: that would hang the run instead of ending it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _failure_code(exit: SystemExit) -> int:
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1


def _exit_with_launcher() -> None:
    """Ends this process soon after the launcher dies (even by SIGKILL), so no orphan keeps running."""
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        _exit_now(1)

    threading.Thread(target=watch, name="torchshard-launcher-watch", daemon=True).start()


class _ImportBeats(importlib.abc.MetaPathFinder):
    """The main thread importing a module it had not imported is progress: a stuck import imports nothing more."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if threading.current_thread() is threading.main_thread():
            heartbeat()
        return None  # the next finder imports it


def main(argv: list[str]) -> None:
    """Runs ``argv[0]`` with arguments ``argv[1:]`` after `torchshard.distributed.initialize`."""
    # first, so a hang anywhere (importing and joining the group included) can be shown: the
    # launcher sends the signal when no process makes progress; the dump comes from C, even if
    # Python is blocked
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    sys.meta_path.insert(0, _ImportBeats())
    _exit_with_launcher()
    from torchshard._multihost.runtime import initialize

    # before the script touches JAX: the launcher's TORCHSHARD_* variables say how to join
    initialize()
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` would
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        if code := _failure_code(exit):
            _exit_now(code)
    except BaseException:
        traceback.print_exc()
        _exit_now(1)


if __name__ == "__main__":
    main(sys.argv[1:])
