"""Where a step's time goes: the top ops by device time, from ``torch.profiler`` or ``jax.profiler``.

Each function runs ``step(i)`` for a few steps under its framework's profiler and returns the ops that took
the most device time (on a GPU, its kernels or XLA ops; on the CPU, where nothing runs on a device, the
XLA:CPU thunks or torch's ops) as ``[{"op", "ms", "share"}, ...]``: milliseconds per step and the share of
all the op time profiled.
"""

from __future__ import annotations

import collections
import glob
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

TOP = 15
# XLA:CPU's own bookkeeping events on its threads, which are not ops
_CPU_NOISE = ("ThreadpoolListener", "end: ", "ThunkExecutor", "Execute")


def top_ops(durations: dict[str, float], steps: int, top: int = TOP) -> list[dict[str, Any]]:
    """``durations`` (op → total seconds over ``steps`` steps) as the ``top`` ops: ms per step and share.

    Examples:
        >>> top_ops({"matmul": 0.03, "add": 0.01}, steps=2)
        [{'op': 'matmul', 'ms': 15.0, 'share': 0.75}, {'op': 'add', 'ms': 5.0, 'share': 0.25}]
    """
    total = sum(durations.values()) or 1.0
    ranked = sorted(durations.items(), key=lambda kv: -kv[1])[:top]
    return [{"op": op, "ms": round(s / steps * 1e3, 4), "share": round(s / total, 4)} for op, s in ranked]


def torch_profile(step: Callable[[int], Any], steps: int, *, cuda: bool) -> list[dict[str, Any]]:
    """The top ops of ``steps`` calls of ``step`` by their own (self) device time, CPU time off a GPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    durations: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        device = getattr(event, "self_device_time_total", None)
        if device is None:  # older torch
            device = getattr(event, "self_cuda_time_total", 0.0)
        durations[event.key] += (device if cuda else event.self_cpu_time_total) / 1e6  # µs
    return top_ops({k: v for k, v in durations.items() if v > 0}, steps)


def jax_profile(step: Callable[[int], Any], steps: int) -> list[dict[str, Any]]:
    """The top XLA ops (or GPU kernels) of ``steps`` calls of ``step`` (each must wait for its step), by time."""
    import jax

    logdir = tempfile.mkdtemp(prefix="torchshard-op-profile-")
    with jax.profiler.trace(logdir):
        for i in range(steps):
            step(i)
    paths = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    if not paths:
        return []
    planes = list(jax.profiler.ProfileData.from_file(paths[0]).planes)
    return top_ops(_op_seconds(planes), steps)


def _op_seconds(planes: Iterable[Any]) -> dict[str, float]:
    """Op → seconds: a device's "XLA Ops" line (or its kernels' streams); off a device, XLA:CPU's threads."""
    planes = list(planes)
    devices = [p for p in planes if p.name.startswith("/device:")]
    durations: dict[str, float] = collections.defaultdict(float)
    for plane in devices:
        lines = list(plane.lines)
        ops = [line for line in lines if line.name == "XLA Ops"] or lines
        for line in ops:
            for event in line.events:
                durations[event.name] += event.duration_ns / 1e9
    if devices:
        return dict(durations)
    for plane in planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for event in line.events:
                if event.duration_ns and not event.name.startswith(_CPU_NOISE):
                    durations[event.name] += event.duration_ns / 1e9
    return dict(durations)
