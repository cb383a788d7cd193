"""Child side of ``torchshard.launch``: join the process group, then run the user's script as ``__main__``."""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
import traceback


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


def main(argv: list[str]) -> None:
    """Runs ``argv[0]`` with arguments ``argv[1:]`` after `torchshard.distributed.initialize`."""
    _exit_with_launcher()
    from torchshard import distributed

    # before the script touches JAX: the launcher's TORCHSHARD_* variables say how to join
    distributed.initialize()
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
