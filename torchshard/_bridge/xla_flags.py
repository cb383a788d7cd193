"""The XLA flags training on a GPU wants, added to ``XLA_FLAGS`` before JAX starts its GPU backend.

XLA reads ``XLA_FLAGS`` once, when its backend starts, and aborts the process on a flag it does
not know; so the flags are added only while the backend has not started, only where an NVIDIA
GPU and JAX's CUDA plugin are present, only those the installed XLA libraries name, and never
when the user set ``XLA_FLAGS`` themselves (their setting, even empty, is the whole of it).
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import os
from pathlib import Path

logger = logging.getLogger("torchshard")

# name → value, and why (docs/kernels.md, "XLA flags on GPUs"; NVIDIA JAX-Toolbox's GPU_performance.md)
GPU_FLAGS: dict[str, tuple[str, str]] = {
    "xla_gpu_enable_latency_hiding_scheduler": ("true", "schedules collectives to overlap compute (FSDP's gathers)"),
    "xla_gpu_enable_highest_priority_async_stream": ("true", "collectives on a stream that is not starved"),
    "xla_gpu_enable_triton_gemm": ("false", "bf16 matmuls through cuBLAS, which tunes them for the GPU"),
    "xla_gpu_enable_pipelined_all_gather": ("true", "the next layer's FSDP gather during this layer's work"),
    "xla_gpu_enable_pipelined_reduce_scatter": ("true", "the gradients' reduce-scatter behind the backward"),
    "xla_gpu_enable_pipelined_all_reduce": ("true", "data-parallel all-reduces behind the backward"),
    "xla_gpu_enable_while_loop_double_buffering": ("true", "scanned layers' loop double-buffered for the above"),
    "xla_gpu_all_reduce_combine_threshold_bytes": ("134217728", "fewer, larger all-reduces (128 MiB)"),
    "xla_gpu_all_gather_combine_threshold_bytes": ("134217728", "fewer, larger all-gathers (128 MiB)"),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": ("67108864", "fewer, larger reduce-scatters (64 MiB)"),
}
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
_applied: list[list[str]] = []  # once per process: the flags added (possibly none)


def _nvidia_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*"))


def _plugin_libraries() -> list[Path]:
    """The shared libraries of jaxlib and of every CUDA plugin installed: where XLA's flags are defined."""
    found = []
    for name in ("jaxlib", *CUDA_PLUGINS):
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # a dotted name whose package is missing
            continue
        for folder in spec.submodule_search_locations or [] if spec else []:
            found += [p for p in Path(folder).rglob("*.so") if p.stat().st_size > 1 << 20]
    return found


def _known(names: list[str], libraries: list[Path]) -> list[str]:
    """The names of ``names`` that every library defining GPU flags mentions (an unknown flag aborts XLA)."""
    defining = []
    for path in libraries:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data.find(b"xla_gpu_enable_latency_hiding_scheduler") >= 0:
                defining.append({n for n in names if data.find(n.encode()) >= 0})
    return [n for n in names if defining and all(n in d for d in defining)]


def gpu_flags_for(
    environ: dict[str, str] | os._Environ[str], *, gpu: bool, started: bool, libraries: list[Path]
) -> list[str]:
    """The ``--name=value`` flags to add to ``environ``'s XLA_FLAGS (none: the user set it, no GPU, too late).

    Examples:
        >>> gpu_flags_for({"XLA_FLAGS": ""}, gpu=True, started=False, libraries=[])
        []
    """
    platforms = environ.get("JAX_PLATFORMS", "")
    if "XLA_FLAGS" in environ or not gpu or started or (platforms and "cuda" not in platforms):
        return []
    return [f"--{n}={GPU_FLAGS[n][0]}" for n in _known(list(GPU_FLAGS), libraries)]


def apply_gpu_flags(*, started: bool) -> list[str]:
    """Adds `GPU_FLAGS` to ``XLA_FLAGS`` once per process where `gpu_flags_for` says to; returns what it added."""
    if _applied:
        return _applied[0]
    gpu = _nvidia_gpu()
    flags = gpu_flags_for(os.environ, gpu=gpu, started=started, libraries=_plugin_libraries() if gpu else [])
    if flags:
        os.environ["XLA_FLAGS"] = " ".join(flags)
        logger.info("XLA_FLAGS for training on a GPU: %s (set XLA_FLAGS yourself to keep XLA's defaults)", flags)
    _applied.append(flags)
    return flags
