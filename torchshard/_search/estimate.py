"""Step time from a compiled step's costs over a hardware profile: compute, memory traffic, links, bubble."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torchshard._hlo.costs import StepCosts
from torchshard._hlo.hardware import Hardware
from torchshard._hlo.hlo import Collective


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds per step and what they are made of.

    Attributes:
        seconds: the estimated step time.
        parts: seconds per cost: ``compute`` (matmul FLOPs over the peak), ``memory`` (bytes accessed over
            the HBM bandwidth), ``comm <axes>`` (collectives over those mesh axes over their links), and
            ``bubble`` (the share of compute a pipeline spends on placeholder micro-batches; already in
            ``compute``), ``attention tiles`` (what the attention tiles pass among their own
            instructions over the HBM bandwidth: XLA's program writes it to memory, a fused flash
            kernel keeps it on chip; not in the step time).
        dominant: the largest part.
    """

    seconds: float
    parts: Mapping[str, float]
    dominant: str


def moved_bytes(op: Collective) -> float:
    """Bytes one device sends for ``op`` under ring algorithms (its result bytes × the algorithm's factor)."""
    n = max(len(op.groups[0]), 1) if op.groups and op.kind != "collective-permute" else 2
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": n - 1,
              "all-to-all": (n - 1) / n, "collective-permute": 1.0}[op.kind]  # fmt: skip
    return op.bytes * factor


def crosses_hosts(op: Collective, devices_per_host: int) -> bool:
    """Whether any group (or source → target pair) of ``op`` spans devices of different hosts."""
    return any(len({p // devices_per_host for p in group}) > 1 for group in op.groups or ())


def estimate(costs: StepCosts, hw: Hardware, *, precision: str, devices_per_host: int, bubble: float) -> Estimate:
    """The step time of ``costs`` on ``hw``.

    Compute and memory traffic overlap (a roofline: the larger counts); collectives over the
    ``data`` axis alone (FSDP's all-gathers and reduce-scatters, the gradient all-reduce) overlap
    with them, as FSDP prefetching arranges; collectives over any other axes (tensor, context,
    stage, expert) sit on the critical path and add. Each collective takes its bytes (ring factor)
    over the intra-host link when its groups stay in a host, else over the inter-host link.

    Examples:
        >>> from torchshard._hlo.hardware import hardware
        >>> e = estimate(StepCosts(989e12, 0.0, ()), hardware("h100"), precision="bf16", devices_per_host=8,
        ...              bubble=0.0)
        >>> e.seconds, e.dominant
        (1.0, 'compute')
    """
    parts = {"compute": costs.flops / hw.peak_flops(precision), "memory": costs.bytes_accessed / hw.hbm_bandwidth}
    for op, count in costs.collectives:
        link = hw.inter_host_bandwidth if crosses_hosts(op, devices_per_host) else hw.intra_host_bandwidth
        key = f"comm {','.join(op.axes) if op.axes else op.over}"
        parts[key] = parts.get(key, 0.0) + count * moved_bytes(op) / link
    overlapped = parts.get("comm data", 0.0)
    critical = sum(v for k, v in parts.items() if k.startswith("comm ") and k != "comm data")
    seconds = max(parts["compute"], parts["memory"], overlapped) + critical
    if bubble:
        parts["bubble"] = parts["compute"] * bubble
    if costs.tile_bytes:
        parts["attention tiles"] = costs.tile_bytes / hw.hbm_bandwidth
    dominant = max((k for k in parts if k not in ("bubble", "attention tiles")), key=lambda k: parts[k])
    return Estimate(seconds, parts, dominant)
