"""A process joined to a multi-process run ends at once on an uncaught exception (`_multihost/failfast.py`).

Each case runs in a fresh Python that loads failfast.py by path (no torch or JAX: it uses the standard library
only); tests/test_torchrun.py checks the same under real torchrun, where a survivor no longer waits for SIGKILL.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FAILFAST = Path(__file__).resolve().parent.parent / "torchshard" / "_multihost" / "failfast.py"
# JAX registers its clean-up (and the shutdown barrier in it) on import, before failfast.install(): the first
# handler stands for it; the second is a user's, registered later (a tracker's final flush)
EXITING = """
import atexit, importlib.util, sys
atexit.register(lambda: print("shutdown barrier", flush=True))
spec = importlib.util.spec_from_file_location("failfast", sys.argv[1])
failfast = importlib.util.module_from_spec(spec)
spec.loader.exec_module(failfast)
failfast.install()
failfast.install()
atexit.register(lambda: print("tracker flushed", flush=True))
sys.excepthook = (lambda previous: lambda *e: (print("user hook", flush=True), previous(*e)))(sys.excepthook)
{end}
"""


@pytest.mark.parametrize(
    "end, code, barrier",
    [
        ("raise RuntimeError('step 4 lost its peer')", 1, False),
        ("raise KeyboardInterrupt", 130, False),
        ("print('done')", 0, True),  # a normal exit still says goodbye to its peers
        ("raise SystemExit(3)", 3, True),  # not an uncaught exception: Python's own exit
    ],
)
def test_an_uncaught_exception_skips_the_shutdown_barrier_after_later_atexit_handlers(end, code, barrier):
    script = EXITING.format(end=end)
    done = subprocess.run([sys.executable, "-c", script, str(FAILFAST)], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert "tracker flushed" in done.stdout and ("shutdown barrier" in done.stdout) == barrier, done.stdout
    if code in (1, 130):  # the traceback as Python prints it, through the user's hook
        assert "user hook" in done.stdout and "Traceback (most recent call last)" in done.stderr, done.stderr
