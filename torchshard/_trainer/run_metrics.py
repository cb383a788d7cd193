"""The figures behind a logged step line: FLOPs of the compiled step, tokens, peak FLOP/s, memory and their line."""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from torchshard._base.format import fmt_bytes
from torchshard._hlo.costs import step_costs
from torchshard._hlo.hardware import for_device_kind
from torchshard._hlo.memory import CompiledMemory

# the step's own metrics, printed first and in this order; the user's aux metrics follow
_LEADING = ("loss", "grad_norm")


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """What one compiled step costs one device: its FLOPs and its memory.

    Attributes:
        flops: matmul FLOPs of the step on one device as compiled, loops counted as often as they
            run and rematerialised forwards counted again (what the chip executes).
        model_flops: ``flops`` with each rematerialised forward counted once: the model FLOPs
            that MFU divides by the peak.
        memory: the compiled step's arguments, temporaries and outputs on one device.
    """

    flops: float
    model_flops: float
    memory: CompiledMemory

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> StepFigures:
        """The figures of a compiled step, from its HLO text and XLA's memory analysis."""
        costs = step_costs(compiled.as_text() or "")
        return cls(costs.flops, costs.model_flops, CompiledMemory.of(compiled))

    @property
    def recompute_ratio(self) -> float:
        """``flops / model_flops``: 1.0 without rematerialisation."""
        return self.flops / self.model_flops if self.model_flops else 1.0


def batch_counts(leaves: Sequence[Any]) -> tuple[int, int]:
    """(tokens, samples) of a batch: the elements of its first integer leaf of rank ≥ 2 (rows × sequence), its rows.

    Tokens are 0 when no leaf looks like token ids (then only samples per second are logged).

    Examples:
        >>> batch_counts([np.zeros((8, 128), np.int64), np.zeros((8, 128), np.float32)])
        (1024, 8)
    """
    ids = next((x for x in leaves if np.ndim(x) >= 2 and np.issubdtype(x.dtype, np.integer)), None)
    tokens = int(ids.shape[0] * ids.shape[1]) if ids is not None else 0
    samples = int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) > 0 else 0
    return tokens, samples


def peak_flops(device: jax.Device, *, low_precision: bool) -> float | None:
    """The device's dense matmul peak, FLOP/s: bf16 for a 16-bit step, else fp32 (TF32); None where unknown (CPU)."""
    profile = for_device_kind(device.device_kind)
    if profile is None:
        return None
    return profile.peak_flops("bf16" if low_precision else "fp32")


def device_memory(devices: Sequence[jax.Device]) -> dict[str, float]:
    """``memory_peak_bytes``, ``memory_bytes`` and ``memory_limit_bytes``: the largest over ``devices``; {} on CPU.

    From the allocator (``device.memory_stats()``), which GPUs and TPUs report and CPUs do not.
    """
    stats = [s for d in devices if (s := d.memory_stats())]
    found = {}
    for key, name in (
        ("peak_bytes_in_use", "memory_peak_bytes"),
        ("bytes_in_use", "memory_bytes"),
        ("bytes_limit", "memory_limit_bytes"),
    ):
        values = [s[key] for s in stats if key in s]
        if values:
            found[name] = float(max(values))
    return found


def host_rss() -> float:
    """This process's resident memory in bytes (its peak where the current figure cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)  # macOS counts bytes, Linux KiB


def step_line(step: int, metrics: Mapping[str, float], *, prefix: str = "") -> str:
    """One logged line, torchtitan's step line: step, loss, grad_norm, memory, tps, tflops, mfu, then the rest.

    Examples:
        >>> step_line(10, {"loss": 2.3456, "grad_norm": 0.5, "tokens_per_s": 12345.6, "mfu": 0.4123,
        ...                "tflops_per_device": 407.8, "memory_peak_bytes": 3 * 2**30})
        'step: 10  loss: 2.3456  grad_norm: 0.5000  memory: 3.00GiB  tps: 12,346  tflops: 407.80  mfu: 41.23%'
    """
    parts = [f"{prefix}step: {step}"]
    parts += [f"{name}: {metrics[name]:.4f}" for name in _LEADING if name in metrics]
    if "memory_peak_bytes" in metrics:
        limit = metrics.get("memory_limit_bytes")
        share = f"({100 * metrics['memory_peak_bytes'] / limit:.2f}%)" if limit else ""
        parts.append(f"memory: {fmt_bytes(metrics['memory_peak_bytes']).replace(' ', '')}{share}")
    shown = {"tokens_per_s": "tps: {:,.0f}", "tflops_per_device": "tflops: {:,.2f}", "mfu": "mfu: {:.2%}",
             "step_time_s": "step_time: {:.4f}s"}  # fmt: skip
    parts += [form.format(metrics[name]) for name, form in shown.items() if name in metrics]
    if metrics.get("recompute_ratio", 1.0) > 1.0:
        parts.append(f"recompute: {metrics['recompute_ratio']:.2f}x")
    hidden = {
        *_LEADING,
        *shown,
        "recompute_ratio",
        "memory_bytes",
        "memory_limit_bytes",
        "memory_peak_bytes",
        "host_rss_bytes",
        "samples_per_s",
    }
    parts += [f"{name}: {value:.4g}" for name, value in metrics.items() if name not in hidden]
    return "  ".join(parts)
