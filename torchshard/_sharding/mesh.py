"""Device meshes with Auto (GSPMD) axes, and simulated CPU devices."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from torchshard._base.errors import ArgumentError, ShardingError
from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.env import backend_started
from torchshard._bridge.xla_flags import apply_gpu_flags

# XLA:CPU runs each device's share of a program on one intra-op thread pool, sized by default to max(cores, devices),
# and an in-process collective holds its thread until every device has joined it. Its thunk executor orders a
# device's collectives only by when they *start*: a while loop or conditional whose body goes asynchronous (work
# handed to the pool) lets the next collective start while the loop's own collectives are still to come. Devices can
# then start two collectives in different orders (jaxlib 0.10.2, falcon_h1's packed ring attention: some devices in
# an all-reduce after the backward ring loop, the others in the loop's next collective-permute). Each device holds a
# pool thread in its collective; with one thread per device none is left for the loop's remaining work, and both
# collectives wait until XLA aborts the process. No XLA option orders the starts (the executor's sequential mode
# has no flag), so the pool gets the threads: XLA sizes it from PJRT_NPROC (else NPROC, else the core count).
THREADS_PER_DEVICE = 4  # one per collective a device can have started: a loop's, and the ones released past it


def use_cpu_devices(n: int) -> None:
    """Makes JAX expose ``n`` CPU devices; call it before anything touches JAX devices.

    Simulated devices share XLA's CPU thread pool, and a collective blocks its thread until all devices join it. A
    device can start a second collective before an earlier one (one inside a loop) has run, in an order that differs
    between devices, so with XLA's default pool (one thread per device on a small machine) the collectives could
    wait on each other until XLA aborts ("Termination timeout ... rendezvous"). Before JAX starts, this sets
    ``PJRT_NPROC`` to ``4 * n`` threads (or the number of cores, if larger) unless ``PJRT_NPROC`` or ``NPROC`` is
    already set, or ``JAX_PLATFORMS`` leaves out the CPU.

    Args:
        n: number of simulated CPU devices (e.g. 8 on a laptop).

    Raises:
        ShardingError: ``n`` is not positive, or JAX already started with a different count.

    Examples:
        >>> import torchshard as ts
        >>> ts.use_cpu_devices(8)  # first thing in the program (a repeat with the same count is a no-op)
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ArgumentError(f"use_cpu_devices(n={n!r}): n must be a positive int.")
    if backend_started():
        have = len(jax.local_devices(backend="cpu"))  # this process's, in a multi-process run too
        if have != n:
            raise ShardingError(
                f"use_cpu_devices({n}) was called after JAX started its backend with {have} CPU "
                f"device(s); the count cannot change now. Call it first thing in your program (before "
                f"jax.devices(), any jax array or torchax tensor), or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n} in the environment."
            )
        return
    _size_cpu_thread_pool(n)
    jax.config.update("jax_num_cpu_devices", n)


def _size_cpu_thread_pool(n: int) -> None:
    """Gives XLA's CPU thread pool `THREADS_PER_DEVICE` threads per device (read when the backend starts)."""
    platforms = jax.config.values.get("jax_platforms")  # JAX_PLATFORMS, or as set in the program
    if "PJRT_NPROC" in os.environ or "NPROC" in os.environ or (platforms and "cpu" not in platforms.split(",")):
        return  # the user's choice (XLA reads PJRT_NPROC, then NPROC), or no CPU backend to size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["PJRT_NPROC"] = str(max(cores, THREADS_PER_DEVICE * n))


def _resolve_sizes(axes: Mapping[str, int], n_devices: int) -> tuple[int, ...]:
    problems = [
        f"axis {name!r} has size {size!r}; sizes must be positive ints or -1"
        for name, size in axes.items()
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1)
    ]
    free = [name for name, size in axes.items() if size == -1]
    if len(free) > 1:
        problems.append(f"only one axis may be -1, got {free}")
    if problems:
        raise ShardingError(problems, header=f"invalid mesh {dict(axes)} for {n_devices} devices")
    fixed = math.prod(s for s in axes.values() if s != -1)
    if free:
        if n_devices % fixed:
            raise ShardingError(
                f"mesh {dict(axes)}: {n_devices} devices cannot be split into axes of size "
                f"{fixed} × {free[0]}; make the fixed sizes divide {n_devices}."
            )
        return tuple(n_devices // fixed if s == -1 else s for s in axes.values())
    if fixed != n_devices:
        raise ShardingError(
            f"mesh {dict(axes)} needs {fixed} devices but {n_devices} are available; make the sizes "
            f"multiply to {n_devices} (or use -1 for one axis), or pass devices= a list of {fixed}."
        )
    return tuple(axes.values())


def _checked_devices(devices: Sequence[jax.Device]) -> list[jax.Device]:
    if isinstance(devices, str | bytes) or not isinstance(devices, Sequence | np.ndarray):
        raise ArgumentError(f"make_mesh(devices={devices!r}): pass a list of jax devices, e.g. jax.devices()[:4]")
    flat = list(np.asarray(devices, dtype=object).reshape(-1))
    problems = [f"devices[{i}] is a {type(d).__name__}, not a jax.Device" for i, d in enumerate(flat)]
    problems = [p for p, d in zip(problems, flat, strict=True) if not isinstance(d, jax.Device)]
    if not flat:
        problems.append("devices= is empty; pass None for all devices, or a non-empty list such as jax.devices()[:4]")
    twice = sorted({str(d) for d in flat if flat.count(d) > 1})
    if twice:
        problems.append(f"devices {twice} are listed more than once; each device may appear once in a mesh")
    raise_for_arguments(problems, header="invalid make_mesh(devices=...)")
    return flat


AXES_FIX = "write axis=size pairs with distinct names, each size a positive int or -1, e.g. data=8,model=8"


def parse_axes(text: str) -> dict[str, int]:
    """Mesh axes written as text, as ``--mesh`` and lm_eval's ``mesh=`` take them, in mesh order.

    Every comma-separated part is ``name=size`` with a distinct, non-empty name and a size that is
    a positive int or ``-1`` (the devices left); an empty part is a mistake, not skipped.

    Args:
        text: e.g. ``"data=4,model=2"``.

    Returns:
        Axis name → size, the ``axes`` of `make_mesh`.

    Raises:
        ArgumentError: the text is not such a list; the message is `AXES_FIX` (the caller names its argument).

    Examples:
        >>> parse_axes("data=-1, model=2")
        {'data': -1, 'model': 2}
        >>> parse_axes("data=4,,model=2")
        Traceback (most recent call last):
        ...
        torchshard._base.errors.ArgumentError: write axis=size pairs with distinct names, each size a positive ...
    """
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = (x.strip() for x in part.partition("="))
        if not sep or not name or name in axes or not re.fullmatch(r"-1|0*[1-9][0-9]*", size):
            raise ArgumentError(AXES_FIX)
        axes[name] = int(size)
    return axes


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a device mesh whose axes are Auto, so GSPMD propagates shardings through torch ops.

    Args:
        axes: axis name → size, in mesh order, e.g. ``{"data": 4, "model": 2}``; one size may be -1.
        devices: the devices to use; defaults to all of ``jax.devices()``.

    Returns:
        A ``jax.sharding.Mesh`` with ``AxisType.Auto`` axes.

    Raises:
        ShardingError: empty or non-string axis names, bad sizes, or sizes that do not use the devices.

    Examples:
        >>> mesh = make_mesh({"data": -1, "model": 2})  # on 8 devices
        >>> dict(mesh.shape)
        {'data': 4, 'model': 2}
    """
    if not isinstance(axes, Mapping) or not axes or not all(isinstance(k, str) and k for k in axes):
        raise ArgumentError(
            f"make_mesh(axes={axes!r}): axes must be a non-empty dict of axis name → size, "
            f'e.g. {{"data": 4, "model": 2}}.'
        )
    if devices is None:
        apply_gpu_flags(started=backend_started())  # before jax.devices() starts the backend
    devices = list(jax.devices() if devices is None else _checked_devices(devices))
    shape = _resolve_sizes(axes, len(devices))
    return jax.make_mesh(shape, tuple(axes), axis_types=(AxisType.Auto,) * len(shape), devices=devices)
