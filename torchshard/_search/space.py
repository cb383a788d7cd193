"""The plan search's space: the model's dims, the meshes and options that can run it, and why none can."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence

import torch

from torchshard._base.errors import ShardingError
from torchshard._strategies import STRATEGIES
from torchshard._train.strategy import SearchAxis

DATA, MODEL = "data", "model"  # the axes of every layout: FSDP / data parallelism, and tensor parallelism


def strategy_axes() -> list[SearchAxis]:
    """The mesh axes the registered strategies lay out (`Strategy.axis`), in registry order."""
    return [s.axis for s in STRATEGIES.values() if s.axis is not None]


def mesh_axes() -> tuple[str, ...]:
    """Mesh order: the last axes vary fastest over the device list, so they stay inside a host (fast links).

    The outer strategy axes (a pipeline's stages), data, the other strategy axes, then the model axis.

    Examples:
        >>> mesh_axes()
        ('stage', 'data', 'context', 'expert', 'model')
    """
    axes = strategy_axes()
    return (*(a.name for a in axes if a.outer), DATA, *(a.name for a in axes if not a.outer), MODEL)


def variants() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the variants a search tries by default, those it may be asked to try): the strategies' (pipeline schedules).

    Examples:
        >>> variants()
        (('gpipe', '1f1b', 'zero_bubble'), ('gpipe', '1f1b', '1f1b_remat', 'zero_bubble'))
    """
    tried: tuple[str, ...] = ()
    allowed: tuple[str, ...] = ()
    for axis in strategy_axes():
        if axis.variants is not None:
            default, possible = axis.variants()
            tried, allowed = tried + default, allowed + possible
    return tried, allowed


def leanest(layout: SearchLayout, choices: Sequence[str]) -> str | None:
    """Of ``choices``, the variant holding the fewest micro-batches' activations on ``layout`` (`SearchAxis.holds`)."""
    if layout.schedule is None:
        return None
    held = [
        (a.holds(v, layout.degree(a.name), layout.microbatches), v)
        for a in strategy_axes()
        if a.holds
        for v in choices
        if layout.degree(a.name) > 1
    ]
    return min(held)[1] if held else layout.schedule


def micro_degree(axes: dict[str, int]) -> int:
    """How many-fold the axes that need micro-batches of their own multiply them (a pipeline's stages)."""
    return math.prod(axes.get(a.name, 1) for a in strategy_axes() if a.microbatches)


def row_axes(axes: dict[str, int]) -> list[str]:
    """The mesh axes a batch's rows split over: data, then each strategy axis that splits rows (experts)."""
    return [DATA, *(a.name for a in strategy_axes() if a.batch_dim == 0 and axes.get(a.name, 1) > 1)]


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
        staged = micro_degree(self.axes) > 1
        micro = f" {'pipeline M' if staged else 'accum'}={self.microbatches}"
        micro += f" {self.schedule}" if self.schedule else ""
        micro = micro if self.microbatches > 1 or staged else ""
        remat = f" remat={self.remat}" if self.remat else ""
        return f"{mesh}{micro}{remat}{' scan' if self.scan else ''} {self.precision}"


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _fits(degree: int, dim: int | None) -> bool:
    return degree == 1 or (dim is not None and dim % degree == 0)


def meshes(devices: int, dims: ModelDims, seq: int) -> Iterator[dict[str, int]]:
    """Every mesh (`mesh_axes`) whose product is ``devices`` and whose degrees divide the dims.

    Tensor degrees divide the query and key/value head counts; each strategy's axis takes the
    degrees its `SearchAxis.fits` allows (stages divide the layers, experts the experts, context
    degrees half the sequence); data takes the rest.
    """

    def tensor(d: int) -> bool:
        return _fits(d, dims.heads) and _fits(d, dims.kv_heads)

    axes: list[tuple[str, Callable[[int], bool]]] = [(MODEL, tensor)]
    axes += [(a.name, functools.partial(a.fits, dims, seq)) for a in strategy_axes()]

    def fill(left: int, i: int, chosen: dict[str, int]) -> Iterator[dict[str, int]]:
        if i == len(axes):
            found = {**chosen, DATA: left}
            yield {a: found[a] for a in mesh_axes()}
            return
        name, fits = axes[i]
        for d in divisors(left):
            if fits(d):
                yield from fill(left // d, i + 1, {**chosen, name: d})

    yield from fill(devices, 0, {})


def batch_problem(axes: dict[str, int], batch: int, microbatches: int) -> bool:
    """Whether ``batch`` rows cannot split over the row axes' shards (`row_axes`) and then into ``microbatches``."""
    return batch % (math.prod(axes[a] for a in row_axes(axes)) * microbatches) != 0


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
        stages = micro_degree(axes)
        varied = any(a.variants is not None and axes[a.name] > 1 for a in strategy_axes())
        scanned = any(a.needs_scan and axes[a.name] > 1 for a in strategy_axes())
        for k in microbatches:
            m = k * stages if stages > 1 else k
            if batch_problem(axes, rows, m):
                continue
            for r, sc, p, s in (
                (r, sc, p, s)
                for r in remat
                for sc in scan
                for p in precision
                for s in (schedules if varied else (None,))
            ):
                if scanned and not sc:
                    continue  # a pipeline stacks its layers: its program is the scanned one
                result.append(SearchLayout(tuple((a, axes[a]) for a in mesh_axes()), m, r, sc, p, s))
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
            not batch_problem(a, batch[0], k * micro_degree(a) if micro_degree(a) > 1 else k)
            for a in meshes(n, dims, batch[1])
            for k in microbatches
        )

    near = [n for n in range(max(1, devices - 16), devices + 17) if n != devices and works(n)]
    closest = sorted(sorted(near, key=lambda n: abs(n - devices))[:4])
    return f"; nearest device counts that split batch {batch[0]}: {closest}"


def _no_batch(rows: int, found: list[dict[str, int]], microbatches: Sequence[int]) -> str:
    splits = sorted(
        {
            math.prod(a[r] for r in row_axes(a)) * (k * micro_degree(a) if micro_degree(a) > 1 else k)
            for a in found
            for k in microbatches
        }
    )
    near = sorted({math.ceil(rows / s) * s for s in splits} | {rows // s * s for s in splits if rows >= s} - {0})
    closest = sorted(near, key=lambda n: (abs(n - rows), n))[:4]
    return (
        f"batch {rows} splits over no configuration of these devices: its rows must divide by the shards of the "
        f"axes that split rows × micro-batches, one of {splits[:12]}; nearest batch sizes that work: {sorted(closest)}"
    )


def analytic_seconds(
    layout: SearchLayout, dims: ModelDims, params: int, batch: tuple[int, int], peak: float, link: float
) -> float:
    """A rough step time to order meshes before compiling: matmul work with remat's recompute and the
    strategies' idle time, FSDP's weight traffic, tensor parallelism's activations, and each strategy's own
    traffic (`SearchAxis.traffic`: the context ring's keys, a pipeline's hops)."""
    tokens = batch[0] * batch[1]
    recompute = {None: 1.0, "nothing_saveable": 4 / 3}.get(layout.remat, 1.1)
    if layout.remat is None and any(
        a.recomputes and layout.schedule and a.recomputes(layout.schedule) for a in strategy_axes()
    ):
        recompute = 4 / 3  # a schedule that replays each layer's forward in its backward (1f1b_remat)
    flops = 6 * params * tokens * recompute / math.prod(layout.axes.values())
    axes = strategy_axes()
    idle = sum(a.idle(layout) for a in axes)
    width = precision_width(layout.precision)
    local = width * tokens / math.prod(layout.degree(a) for a in _split_batch(layout))
    layers = (dims.layers or 1) / micro_degree(layout.axes)
    weights = (
        3
        * width
        * params
        / math.prod([layout.degree(MODEL), *(layout.degree(a.name) for a in axes if a.splits_weights)])
    )
    fsdp = weights * (layout.degree(DATA) - 1) / layout.degree(DATA)
    tp = 8 * layers * local * (dims.hidden or 0) * (layout.degree(MODEL) - 1) / layout.degree(MODEL)
    own = sum(a.traffic(layout, dims, local, layers) for a in axes)
    return flops / peak / (1 - idle) + (fsdp + tp + own) / link


def _split_batch(layout: SearchLayout) -> list[str]:
    """The axes that split a batch's tokens: data and every strategy axis with a batch dim (rows or sequence)."""
    return [DATA, *(a.name for a in strategy_axes() if a.batch_dim is not None)]
