"""``python -m torchshard.launch --nproc N script.py``: run N local processes of one multi-process job."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from torchshard._multihost.launcher import (
    HANG_EXIT,
    HANG_TIMEOUT_S,
    TIMEOUT_EXIT,
    child_env,
    free_port,
    launch,
    note,
    run_processes,
)

__all__ = ["HANG_EXIT", "TIMEOUT_EXIT", "child_env", "free_port", "launch", "main", "parse_args", "run_processes"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ 1")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds ≥ 0")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's command line (everything after the script goes to the script)."""
    parser = argparse.ArgumentParser(
        prog="python -m torchshard.launch",
        description="Run N local processes of one multi-process torchshard job (JAX multi-controller).",
    )
    parser.add_argument("--nproc", type=_positive, required=True, help="number of local processes")
    parser.add_argument("--cpu-devices-per-proc", type=_positive, help="simulated CPU devices per process")
    parser.add_argument("--timeout", type=_seconds, help="seconds before every process is killed (exit 124)")
    parser.add_argument(
        "--hang-timeout",
        type=_seconds,
        default=HANG_TIMEOUT_S,
        metavar="S",
        help="when no process prints a line or beats its heartbeat for S seconds, every process prints its Python "
        f"stacks and the run stops (exit {HANG_EXIT}); 0 turns it off (default: %(default)g)",
    )
    parser.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torchshard.launch``; returns the exit code."""
    args = parse_args(argv)
    if not os.path.isfile(args.script):
        note(f"no such script: {args.script}")
        return 2
    return launch(
        args.script,
        args.args,
        nproc=args.nproc,
        cpu_devices_per_proc=args.cpu_devices_per_proc,
        timeout=args.timeout,
        hang_timeout=args.hang_timeout,
        port=args.port,
    )


if __name__ == "__main__":
    sys.exit(main())
