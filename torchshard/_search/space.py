"""The plan search's space: the model's dims, the meshes and options that can run it, and why none can."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import torch

from torchshard._base.errors import ShardingError
from torchshard._base.schedule import bubble_fraction

# mesh order: the last axes vary fastest over the device list, so they stay inside a host (fast links)
AXES = ("stage", "data", "context", "expert", "model")


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """What the degrees of a mesh must divide: head counts, layers, experts (None where unknown or absent)."""

    layers: int | None
    heads: int | None
    kv_heads: int | None
    experts: int | None
    hidden: int | None

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelDims:
        config = getattr(model, "config", None)
        get = lambda *names: next((int(v) for n in names if isinstance(v := getattr(config, n, None), int)), None)  # noqa: E731
        layers = get("num_hidden_layers", "n_layer", "num_layers") or _longest_stack(model)
        heads = get("num_attention_heads", "n_head")
        experts = get("num_local_experts", "num_experts", "n_routed_experts")
        return cls(layers, heads, get("num_key_value_heads") or heads, experts, get("hidden_size", "n_embd"))


def _longest_stack(model: torch.nn.Module) -> int | None:
    lengths = [len(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lengths, default=0) or None


# a candidate's precision → the compute dtype of its MixedPrecision policy (None: float32, no policy): the one home
# of the names --precisions takes, the policy the candidate compiles under and the widths the estimate counts
PRECISIONS: dict[str, torch.dtype | None] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def precision_width(precision: str) -> int:
    """Bytes per activation element under ``precision`` (a name of `PRECISIONS`)."""
    dtype = PRECISIONS[precision]
    return 4 if dtype is None else dtype.itemsize


@dataclasses.dataclass(frozen=True)
class SearchLayout:
    """One configuration: mesh degrees and Trainer options.

    ``microbatches`` is ``Pipeline(microbatches=...)`` when ``stage > 1``, else ``grad_accum_steps``.
    ``remat`` is a ``jax.checkpoint`` policy name applied to every layer, or None for no remat.
    ``schedule`` is the pipeline's ``Pipeline(schedule=...)`` when ``stage > 1``, else None.
    """

    mesh: tuple[tuple[str, int], ...]
    microbatches: int = 1
    remat: str | None = None
    scan: bool = True
    precision: str = "bf16"
    schedule: str | None = None

    @property
    def axes(self) -> dict[str, int]:
        return dict(self.mesh)

    def degree(self, axis: str) -> int:
        return self.axes.get(axis, 1)

    def label(self) -> str:
        """``data=8,model=2 M=4 remat=nothing_saveable scan bf16``: one line of the table."""
        mesh = ",".join(f"{a}={n}" for a, n in self.mesh if n > 1) or "data=1"
        micro = f" {'pipeline M' if self.degree('stage') > 1 else 'accum'}={self.microbatches}"
        micro += f" {self.schedule}" if self.schedule else ""
        micro = micro if self.microbatches > 1 or self.degree("stage") > 1 else ""
        remat = f" remat={self.remat}" if self.remat else ""
        return f"{mesh}{micro}{remat}{' scan' if self.scan else ''} {self.precision}"


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _fits(degree: int, dim: int | None) -> bool:
    return degree == 1 or (dim is not None and dim % degree == 0)


def meshes(devices: int, dims: ModelDims, seq: int) -> Iterator[dict[str, int]]:
    """Every (stage, data, context, expert, model) whose product is ``devices`` and whose degrees divide the dims.

    Tensor degrees divide the query and key/value head counts, stage degrees the layers, expert
    degrees the experts, context degrees half the sequence (load-balanced ring chunks).
    """
    for t in divisors(devices):
        if not (_fits(t, dims.heads) and _fits(t, dims.kv_heads)):
            continue
        for s in divisors(devices // t):
            if not _fits(s, dims.layers):
                continue
            for c in divisors(devices // (t * s)):
                if c > 1 and seq % (2 * c):
                    continue
                for e in divisors(devices // (t * s * c)):
                    if _fits(e, dims.experts):
                        yield {"stage": s, "data": devices // (t * s * c * e), "context": c, "expert": e, "model": t}


def batch_problem(axes: dict[str, int], batch: int, microbatches: int) -> bool:
    """Whether ``batch`` rows cannot split over data × expert shards and then into ``microbatches``."""
    return batch % (axes["data"] * axes["expert"] * microbatches) != 0


def layouts(
    devices: int,
    dims: ModelDims,
    batch: tuple[int, int],
    *,
    microbatches: Sequence[int],
    remat: Sequence[str | None],
    scan: Sequence[bool],
    precision: Sequence[str],
    schedules: Sequence[str] = ("gpipe",),
) -> list[SearchLayout]:
    """Every valid layout, or a `ShardingError` naming the device counts or batch sizes that would have some.

    ``schedules`` are the pipeline schedules a mesh with a ``stage`` axis is tried with.
    """
    rows, seq = batch
    found = list(meshes(devices, dims, seq))
    if not found:
        raise ShardingError(_no_mesh(devices, dims, seq))
    result = []
    for axes in found:
        stages = axes["stage"]
        for k in microbatches:
            m = k * stages if stages > 1 else k
            if batch_problem(axes, rows, m):
                continue
            for r, sc, p, s in ((r, sc, p, s) for r in remat for sc in scan for p in precision
                                for s in (schedules if stages > 1 else (None,))):  # fmt: skip
                if stages > 1 and not sc:
                    continue  # a pipeline stacks its layers: its program is the scanned one
                result.append(SearchLayout(tuple((a, axes[a]) for a in AXES), m, r, sc, p, s))
    if not result:
        raise ShardingError(_no_batch(rows, found, microbatches) + _other_devices(devices, dims, batch, microbatches))
    return result


def _no_mesh(devices: int, dims: ModelDims, seq: int) -> str:
    near = [n for n in range(max(1, devices - 8), devices + 9) if n != devices and any(meshes(n, dims, seq))]
    closest = sorted(near, key=lambda n: (abs(n - devices), n))[:4]
    return (
        f"no mesh of {devices} devices fits this model: every degree must divide its dims (heads "
        f"{dims.heads}, kv heads {dims.kv_heads}, layers {dims.layers}, experts {dims.experts}, half the "
        f"sequence {seq // 2}) and the product be {devices}; "
        f"nearest device counts that work: {sorted(closest)}"
    )


def _other_devices(devices: int, dims: ModelDims, batch: tuple[int, int], microbatches: Sequence[int]) -> str:
    def works(n: int) -> bool:
        return any(
            not batch_problem(a, batch[0], k * a["stage"] if a["stage"] > 1 else k)
            for a in meshes(n, dims, batch[1])
            for k in microbatches
        )

    near = [n for n in range(max(1, devices - 16), devices + 17) if n != devices and works(n)]
    closest = sorted(sorted(near, key=lambda n: abs(n - devices))[:4])
    return f"; nearest device counts that split batch {batch[0]}: {closest}"


def _no_batch(rows: int, found: list[dict[str, int]], microbatches: Sequence[int]) -> str:
    splits = sorted(
        {a["data"] * a["expert"] * (k * a["stage"] if a["stage"] > 1 else k) for a in found for k in microbatches}
    )
    near = sorted({math.ceil(rows / s) * s for s in splits} | {rows // s * s for s in splits if rows >= s} - {0})
    closest = sorted(near, key=lambda n: (abs(n - rows), n))[:4]
    return (
        f"batch {rows} splits over no configuration of these devices: its rows must divide by data × expert "
        f"shards × micro-batches, one of {splits[:12]}; nearest batch sizes that work: {sorted(closest)}"
    )


def analytic_seconds(
    layout: SearchLayout, dims: ModelDims, params: int, batch: tuple[int, int], peak: float, link: float
) -> float:
    """A rough step time to order meshes before compiling: matmul work with remat's recompute and the
    pipeline bubble, FSDP's weight traffic, tensor parallelism's activations, the context ring's keys."""
    tokens = batch[0] * batch[1]
    recompute = {None: 1.0, "nothing_saveable": 4 / 3}.get(layout.remat, 1.1)
    if layout.schedule == "1f1b_remat" and layout.remat is None:
        recompute = 4 / 3  # its backward replays each layer's forward
    flops = 6 * params * tokens * recompute / math.prod(layout.axes.values())
    stages, m = layout.degree("stage"), layout.microbatches
    bubble = bubble_fraction(stages, m, schedule=layout.schedule)
    width = precision_width(layout.precision)
    local = width * tokens / (layout.degree("data") * layout.degree("expert") * layout.degree("context"))
    layers = (dims.layers or 1) / stages
    weights = 3 * width * params / (stages * layout.degree("model") * layout.degree("expert"))
    fsdp = weights * (layout.degree("data") - 1) / layout.degree("data")
    tp = 8 * layers * local * (dims.hidden or 0) * (layout.degree("model") - 1) / layout.degree("model")
    kv = (dims.hidden or 0) * (dims.kv_heads or 1) / (dims.heads or 1) / layout.degree("model")
    ring = 6 * layers * local * kv * (layout.degree("context") - 1)
    hops = 2 * m * local * (dims.hidden or 0) / m if stages > 1 else 0.0
    return flops / peak / (1 - bubble) + (fsdp + tp + ring + hops) / link
