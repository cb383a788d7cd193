"""The launcher's machinery: start N local processes of one job, forward signals, stop them all on failure."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from torchshard._multihost import runtime as distributed
from torchshard._multihost.worker import HEARTBEAT_ENV, STACKS_SIGNAL
from torchshard._multihost.worker import command as worker_command

TIMEOUT_EXIT = 124
HANG_EXIT = 125
HANG_TIMEOUT_S = 600.0
_POLL_S = 0.05
_GRACE_S = 3.0
TERM_GRACE_S = 60.0  # after a forwarded SIGTERM: time to save a checkpoint and exit (see distributed.preempted)
_QUIET_S = 0.5  # a stack dump is complete once its process has printed nothing for this long
_DUMP_WAIT_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for the coordinator of a local run).

    Examples:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(rank: int, nproc: int, port: int, cpu_devices: int | None, base: dict[str, str]) -> dict[str, str]:
    """The environment of process ``rank``: ``base`` plus what `torchshard.distributed.initialize` reads."""
    env = dict(base)
    env.update(
        {
            distributed.COORDINATOR_ENV: f"127.0.0.1:{port}",
            distributed.NUM_PROCESSES_ENV: str(nproc),
            distributed.PROCESS_ID_ENV: str(rank),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cpu_devices is not None:
        env[distributed.CPU_DEVICES_ENV] = str(cpu_devices)
        env["JAX_PLATFORMS"] = "cpu"  # simulated devices: keep local accelerators out of the mesh
    return env


@dataclasses.dataclass
class _Child:
    rank: int
    popen: subprocess.Popen[bytes]
    heartbeat: pathlib.Path
    last_output: float = dataclasses.field(default_factory=time.monotonic)
    reader: threading.Thread | None = None

    def idle_s(self) -> float:
        """Seconds since this process last printed a line or beat its heartbeat (`worker.heartbeat`)."""
        output = time.monotonic() - self.last_output
        try:
            return min(output, time.time() - self.heartbeat.stat().st_mtime)
        except OSError:
            return output


def _pump(child: _Child, stream, out: TextIO, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        child.last_output = time.monotonic()
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            out.write(f"[rank {child.rank}] {line}\n")
            out.flush()
    child.last_output = time.monotonic()  # its end is progress too: the others get a full timeout after it
    stream.close()


def _start(
    rank: int, command: list[str], env: dict[str, str], out: TextIO, lock: threading.Lock, heartbeat: pathlib.Path
) -> _Child:
    heartbeat.touch()
    # a session of its own: a terminal's Ctrl-C reaches only the launcher, which forwards it,
    # and killing the group also ends anything the script started
    env = {**env, HEARTBEAT_ENV: str(heartbeat)}
    popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    child = _Child(rank, popen, heartbeat)
    child.reader = threading.Thread(target=_pump, args=(child, popen.stdout, out, lock), daemon=True)
    child.reader.start()
    return child


def _signal_group(child: _Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.popen.pid, sig)


def _stop(children: Sequence[_Child], *, grace: float = _GRACE_S) -> None:
    """SIGTERM every process group still running, then SIGKILL what is left after a grace period.

    Processes inside ``jax.distributed`` note SIGTERM as a preemption and keep running, so
    they usually take the SIGKILL; a script's own SIGTERM handler still gets the grace period.
    """
    alive = [c for c in children if c.popen.poll() is None]
    for child in alive:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(c.popen.poll() is None for c in alive) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for child in children:
        _signal_group(child, signal.SIGKILL)
        child.popen.wait()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class _Supervisor:
    """Watches the children: first failure, timeout, hang or forwarded signal ends the whole run."""

    def __init__(
        self, children: list[_Child], timeout: float | None, hang_timeout: float | None, term_grace: float
    ) -> None:
        self.children = children
        self.term_grace = term_grace
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.hang_timeout = hang_timeout
        self.signals: list[int] = []
        self.signalled_at = 0.0

    def forward(self, sig: int, _frame: object = None) -> None:
        if not self.signals:
            self.signalled_at = time.monotonic()
        self.signals.append(sig)
        for child in self.children:
            _signal_group(child, sig if len(self.signals) == 1 else signal.SIGKILL)

    def wait(self) -> int:
        while (code := self._outcome()) is None:
            time.sleep(_POLL_S)
        return code

    def _outcome(self) -> int | None:
        codes = [c.popen.poll() for c in self.children]
        if self.signals:
            # a preempted run saves and exits (distributed.preempted); one that never looks (JAX's
            # preemption notifier catches SIGTERM) is killed after the grace period
            grace = self.term_grace if self.signals[0] == signal.SIGTERM else _GRACE_S
            if all(code == 0 for code in codes):
                return 0  # every process saved and exited cleanly
            done = all(code is not None for code in codes) or time.monotonic() > self.signalled_at + grace
            return 128 + self.signals[0] if done else None
        failed = next((c for c in self.children if c.popen.returncode not in (None, 0)), None)
        if failed is not None:
            note(f"rank {failed.rank} exited with code {failed.popen.returncode}; stopping the others")
            return _exit_code(failed.popen.returncode)
        if all(code == 0 for code in codes):
            return 0
        if self.deadline is not None and time.monotonic() > self.deadline:
            note("timed out; stopping every process")
            return TIMEOUT_EXIT
        if self.hang_timeout and min(c.idle_s() for c in self.children) > self.hang_timeout:
            _report_hang([c for c in self.children if c.popen.poll() is None], self.hang_timeout)
            return HANG_EXIT
        return None


def _report_hang(running: Sequence[_Child], hang_timeout: float) -> None:
    """Names the stalled ranks and has each print its Python stacks (faulthandler, registered by the worker)."""
    ranks = ", ".join(str(c.rank) for c in running)
    idle = ", ".join(f"rank {c.rank} {c.idle_s():.1f} s" for c in running)
    note(
        f"no process made progress (printed output or heartbeat) for {hang_timeout:g} s; ranks {ranks} are stalled "
        f"(idle: {idle}); their Python stacks follow"
    )
    for child in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.popen.pid, STACKS_SIGNAL)  # the worker itself only: its children may not handle it
    started = time.monotonic()
    while time.monotonic() - started < _DUMP_WAIT_S:  # until the dumps have been printed
        if time.monotonic() - max(c.last_output for c in running) > _QUIET_S and time.monotonic() - started > _QUIET_S:
            break
        time.sleep(_POLL_S)
    note(f"stopping every process: ranks {ranks} hung (raise --hang-timeout if they were only slow)")


def note(message: str) -> None:
    print(f"[launch] {message}", file=sys.stderr, flush=True)


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    nproc: int,
    cpu_devices_per_proc: int | None = None,
    timeout: float | None = None,
    hang_timeout: float | None = HANG_TIMEOUT_S,
    port: int | None = None,
    out: TextIO | None = None,
) -> int:
    """Runs ``script`` in ``nproc`` local processes joined into one JAX run; returns the exit code.

    Each process calls `torchshard.distributed.initialize` before the script runs (a script
    may call it again). Output lines are prefixed ``[rank i]``. The first process to fail, a
    timeout (exit 124), a hang (exit 125) or a SIGINT/SIGTERM (forwarded to every process)
    ends all of them. After a SIGTERM the processes get ``TERM_GRACE_S`` (60 s) to save and
    exit (`torchshard.distributed.preempted`): if every one exits 0, so does the launcher.

    A hang: no process made progress for ``hang_timeout`` seconds, where progress is a line of
    output, a heartbeat (``torchshard._multihost.worker.heartbeat()``, called from the training loop) or
    the main thread importing a new module; a process's exit counts too. Every process then
    prints its Python stacks (faulthandler) before the run is stopped.

    Args:
        script: path of the Python script.
        args: its command-line arguments.
        nproc: number of processes.
        cpu_devices_per_proc: simulated CPU devices per process (forces ``JAX_PLATFORMS=cpu``).
        timeout: seconds before every process is killed.
        hang_timeout: seconds without progress from any process before the run counts as hung
            (``None`` or 0: never).
        port: coordinator port on 127.0.0.1; defaults to a free one.
        out: where the prefixed output goes; defaults to ``sys.stdout``.

    Returns:
        0 if every process succeeded (after a SIGTERM too), else the first failing process's exit
        code (128 + signal).

    Examples:
        >>> launch("train.py", ["--steps", "2"], nproc=2, cpu_devices_per_proc=4)  # doctest: +SKIP
        0
    """
    port = free_port() if port is None else port
    command = worker_command([script, *args])
    envs = [child_env(rank, nproc, port, cpu_devices_per_proc, dict(os.environ)) for rank in range(nproc)]
    return run_processes(command, envs, timeout=timeout, hang_timeout=hang_timeout, out=out)


def run_processes(
    command: Sequence[str],
    envs: Sequence[dict[str, str]],
    *,
    timeout: float | None = None,
    hang_timeout: float | None = HANG_TIMEOUT_S,
    term_grace: float = TERM_GRACE_S,
    out: TextIO | None = None,
) -> int:
    """Runs ``command`` once per environment in ``envs`` (rank = position) and supervises the group.

    Args:
        command: the program and its arguments, the same for every process.
        envs: one full environment per process.
        timeout: seconds before every process is killed (exit 124).
        hang_timeout: seconds without output or heartbeat from any process before it is a hang
            (exit 125, after each process printed its stacks); ``None`` or 0: never.
        term_grace: seconds the processes get to exit after a forwarded SIGTERM (to save a
            checkpoint) before they are killed.
        out: where the ``[rank i]``-prefixed output goes; defaults to ``sys.stdout``.

    Returns:
        As for `launch`.

    Examples:
        >>> run_processes([sys.executable, "-c", "pass"], [dict(os.environ)] * 2)  # doctest: +SKIP
        0
    """
    out = sys.stdout if out is None else out
    lock = threading.Lock()
    children: list[_Child] = []
    supervisor = _Supervisor(children, timeout, hang_timeout, term_grace)
    previous = {sig: signal.signal(sig, supervisor.forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    with tempfile.TemporaryDirectory(prefix="torchshard-launch-") as beats:
        try:
            for rank, env in enumerate(envs):
                children.append(_start(rank, list(command), env, out, lock, pathlib.Path(beats, f"rank{rank}")))
            return supervisor.wait()
        finally:
            _stop(children, grace=0.0 if supervisor.signals else _GRACE_S)  # a signal had its grace period
            for child in children:
                if child.reader is not None:
                    child.reader.join(timeout=_GRACE_S)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
