"""The plan search's compiles in a child process: a fatal XLA check there fails one candidate, not the search.

XLA aborts the process on some internal checks (``F hlo_instruction.cc ...``); no Python handler
runs. So the search hands each layout to one long-lived child (``python -m
torchshard._search.compile_worker``), which starts JAX with the search's simulated CPU devices,
unpickles the problem once, and compiles layout after layout (its compile cache kept). A child
that dies is replaced by a fresh one for the next layout; the layout it died on is a failure whose
reason is the child's last fatal log line and the signal. Requests and replies are pickles on the
child's stdin and on a duplicate of its stdout (stdout itself then writes to stderr, so that
nothing a library prints is read as a reply). Pickles come only from this process and its child.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
import threading
import traceback
from typing import IO, Any

from torchshard._base.errors import ShardingError
from torchshard._search.search_compile import Compiled, Problem, measure
from torchshard._search.space import SearchLayout

_log = logging.getLogger("torchshard")
_SIZE = struct.Struct("<Q")
# what a dying XLA or Python says last: glog's fatal lines (F1126 17:00:00.12  42 file.cc:1] ...) and Python's own
_FATAL = re.compile(r"^(?:F\d{4} [\d:.]+\s+\d+ (.*)|(Fatal Python error: .*))$")


# what children measured or why they could not, kept here: a second search in this process (another hardware)
# compiles nothing, nor retries a layout that aborted
_MEASURED: dict[tuple[Any, ...], Compiled | tuple[type[Exception], str]] = {}


def forget() -> None:
    """Forgets what the children measured (tests)."""
    _MEASURED.clear()


class CompileFailed(Exception):
    """A candidate whose compile raised or killed the compiling process; the message says why."""


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(_SIZE.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_SIZE.size)
    if len(head) < _SIZE.size:
        raise EOFError("the compiling process closed its end")
    size = _SIZE.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the compiling process closed its end mid-reply")
    return pickle.loads(data)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class Compiler:
    """Measures layouts in a child process while the problem can be sent to one, else in this process.

    Use as a context manager: the child is stopped on exit.
    """

    def __init__(self, problem: Problem, devices: list[Any]) -> None:
        self.problem, self.devices = problem, devices
        self.child: subprocess.Popen[bytes] | None = None
        self.stderr: collections.deque[str] = collections.deque(maxlen=64)
        self.reader: threading.Thread | None = None
        self.ready = False
        self.payload: bytes | None = self._payload()

    def _payload(self) -> bytes | None:
        try:
            return pickle.dumps(self.problem)
        except Exception as e:  # a lambda loss, a class of __main__ (PicklingError, AttributeError, TypeError)
            _log.warning(
                "plan search: compiling in this process, as the model or loss cannot be sent to a child "
                "(%s); a fatal XLA error will end the search",
                _first_line(e),
            )
            return None

    def __enter__(self) -> Compiler:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def measure(self, layout: SearchLayout) -> Compiled:
        """The layout's peak and costs (`measure`).

        Raises:
            ShardingError: the layout cannot be laid out on the model (as `measure` raises it).
            CompileFailed: the compile raised anything else, or killed the compiling process.
        """
        if self.payload is None:
            return self._here(layout)
        key = (id(self.problem.model), layout, self.problem.batch, self.problem.loss_fn)
        if key not in _MEASURED:
            if self.child is None:
                self._spawn()
            if not self.ready and not self._await_ready():
                return self._here(layout)  # and so from now on
            try:
                _MEASURED[key] = self._ask(layout)
            except (ShardingError, CompileFailed) as e:
                _MEASURED[key] = (type(e), str(e))
        found = _MEASURED[key]
        if isinstance(found[0], type):
            raise found[0](found[1])
        return found

    def _here(self, layout: SearchLayout) -> Compiled:
        try:
            return measure(self.problem, layout, self.devices)
        except ShardingError:
            raise
        except Exception as e:
            raise CompileFailed(_first_line(e)) from e

    def _ask(self, layout: SearchLayout) -> Compiled:
        assert self.child is not None and self.child.stdin is not None and self.child.stdout is not None
        try:
            _send(self.child.stdin, layout)
            kind, value = _receive(self.child.stdout)
        except (EOFError, OSError):
            raise CompileFailed(self._died()) from None
        if kind == "sharding":
            raise ShardingError(value)
        if kind == "failed":
            raise CompileFailed(value)
        return value

    def _spawn(self) -> None:
        """Starts a child and sends it the devices and the problem."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if isinstance(p, str) and p))
        command = [sys.executable, "-m", "torchshard._search.compile_worker"]
        self.stderr.clear()
        self.child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        self.ready = False
        self.reader = threading.Thread(target=self._drain, args=(self.child.stderr,), daemon=True)
        self.reader.start()
        assert self.child.stdin is not None
        with contextlib.suppress(OSError):  # a child dead at once is found out by _await_ready
            _send(self.child.stdin, (len(self.devices), self.payload))

    def _await_ready(self) -> bool:
        """Whether the child took the problem; where it cannot, compiles stay in this process from now on."""
        assert self.child is not None and self.child.stdout is not None
        try:
            kind, why = _receive(self.child.stdout)
        except (EOFError, OSError):
            kind, why = "unavailable", self._died()
        self.ready = kind == "ready"
        if self.ready:
            return True
        self.close()
        _log.warning(
            "plan search: compiling in this process, as a child process cannot take the problem (%s); a "
            "fatal XLA error will end the search",
            why,
        )
        self.payload = None
        return False

    def _drain(self, stream: IO[bytes]) -> None:
        for raw in stream:  # kept for the reason of a death; shown at DEBUG
            line = raw.decode(errors="replace").rstrip()
            self.stderr.append(line)
            _log.debug("plan search compile process: %s", line)

    def _died(self) -> str:
        """Why the child stopped answering (it is gone after this; the next layout starts a fresh one)."""
        assert self.child is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.child.wait(timeout=30)
        if self.child.poll() is None:
            self.child.kill()
            self.child.wait()
        if self.reader is not None:
            self.reader.join(timeout=5)
        child, self.child = self.child, None
        code = child.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        fatal = [m.group(1) or m.group(2) for line in self.stderr if (m := _FATAL.match(line.strip()))]
        _close(child)
        return f"the compiling process was {how}" + (f": {fatal[-1][:300]}" if fatal else "")

    def close(self) -> None:
        """Stops the child (it exits when its input closes)."""
        child, self.child = self.child, None
        if child is None:
            return
        with contextlib.suppress(OSError):
            assert child.stdin is not None
            child.stdin.close()  # the child's loop ends at the end of its input
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if self.reader is not None:
            self.reader.join(timeout=5)
        _close(child)


def _close(child: subprocess.Popen[bytes]) -> None:
    for stream in (child.stdin, child.stdout, child.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """The child: JAX started with the search's devices, then one reply per layout until the input closes."""
    from torchshard._report.fit import simulated_devices

    count, payload = _receive(requests)
    devices = simulated_devices(count)  # before the problem's unpickling could touch JAX
    try:
        problem = pickle.loads(payload)
    except Exception as e:  # e.g. a model class defined in the parent's __main__
        _send(replies, ("unavailable", _first_line(e)))
        return
    _send(replies, ("ready", None))
    while True:
        try:
            layout = _receive(requests)
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", measure(problem, layout, devices))
        except ShardingError as e:
            reply = ("sharding", str(e))
        except Exception as e:
            traceback.print_exc()  # on stderr, which the search logs at DEBUG
            reply = ("failed", _first_line(e))
        _send(replies, reply)


def main() -> None:
    """Entry point of the child process."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever prints to stdout goes to stderr: stdout's duplicate carries only replies
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
