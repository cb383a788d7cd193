"""The plan search's space: the model's dims, the meshes and options that can run it, and why none can."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from torchshard._base.errors import ShardingError
from torchshard._strategies import STRATEGIES
from torchshard._train.precision import compute_width
from torchshard._train.remat import DEFAULT_POLICY
from torchshard._train.search_seam import GRAD_ACCUM, SearchAxis, SearchOption

Choices = Mapping[str, Sequence[Any]]  # a search option's name → the values to try
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


def search_choices() -> list[SearchOption]:
    """What the registered strategies give the search to vary (`Strategy.search_options`), in registry order: each
    a `search` keyword and a ``plan --search`` flag."""
    return [o for s in STRATEGIES.values() for o in s.search_options]


def counts(option: SearchOption) -> bool:
    """Whether ``option``'s values are counts of micro-batches (tried first: the batch must split into them)."""
    return option.allowed is None


def allowed(option: SearchOption) -> tuple[Any, ...] | None:
    """The values ``option`` may be given (`SearchOption.allowed`); None for counts."""
    return None if option.allowed is None else tuple(option.allowed())


def choice_values(choices: Choices) -> dict[str, Any]:
    """Each search option's values (`search_choices`, by name): those given in ``choices``, else its own defaults.

    Raises:
        TypeError: a name no search option has (as Python says of `search`'s unknown keywords).
    """
    options = {o.name: o for o in search_choices()}
    for name in choices:
        if name not in options:
            raise TypeError(f"search() got an unexpected keyword argument {name!r}")
    return {name: choices.get(name, tuple(o.tried())) for name, o in options.items()}


Dimension = Callable[["SearchLayout"], Any]  # one option of a layout, as the search varies it


def _chosen(option: SearchOption) -> Dimension:
    return lambda lay: tuple(lay.option(key) for key in option.keys)


def dimensions() -> list[Dimension]:
    """A layout's options in the order the search refines them: remat, the counts, precision, scan, the others."""
    choices = search_choices()
    return [
        lambda lay: lay.remat,
        *(_chosen(o) for o in choices if counts(o)),
        lambda lay: lay.precision,
        lambda lay: lay.scan,
        *(_chosen(o) for o in choices if not counts(o)),
    ]


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


@dataclasses.dataclass(frozen=True)
class SearchLayout:
    """One configuration: mesh degrees and Trainer options.

    ``remat`` is a ``jax.checkpoint`` policy name applied to every layer, or None for no remat.
    ``options`` are what the strategies' search choices set (`SearchOption.sets`) as ``(key, value)``
    pairs, read with `option`: `GRAD_ACCUM` (the Trainer's ``grad_accum_steps``) and each strategy's own.
    """

    mesh: tuple[tuple[str, int], ...]
    remat: str | None = None
    scan: bool = True
    precision: str = "bf16"
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def axes(self) -> dict[str, int]:
        return dict(self.mesh)

    def degree(self, axis: str) -> int:
        return self.axes.get(axis, 1)

    def option(self, key: str, default: Any = None) -> Any:
        """The value the strategies' search choices set for ``key`` here, else ``default``."""
        return dict(self.options).get(key, default)

    @property
    def splits(self) -> int:
        """How many micro-batches a step splits its rows into: accumulation × each strategy's (`SearchAxis.rows`)."""
        return self.option(GRAD_ACCUM, 1) * math.prod(a.rows(self) for a in strategy_axes())

    def label(self) -> str:
        """``data=8,model=2 accum=4 remat=nothing_saveable scan bf16``: one line of the table."""
        mesh = ",".join(f"{a}={n}" for a, n in self.mesh if n > 1) or "data=1"
        accum = f" accum={k}" if (k := self.option(GRAD_ACCUM, 1)) > 1 else ""
        own = "".join(a.label(self) for a in strategy_axes())
        remat = f" remat={self.remat}" if self.remat else ""
        return f"{mesh}{accum}{own}{remat}{' scan' if self.scan else ''} {self.precision}"


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


def batch_problem(axes: dict[str, int], batch: int, splits: int) -> bool:
    """Whether ``batch`` rows cannot split over the row axes' shards (`row_axes`), then into ``splits`` pieces."""
    return batch % (math.prod(axes[a] for a in row_axes(axes)) * splits) != 0


def picks(axes: dict[str, int], choices: Choices, *, counted: bool) -> list[tuple[tuple[str, Any], ...]]:
    """The distinct layout options the search choices (those of `counts`, or the others) give a mesh, in order:
    every combination of their values (``choices``, else their own defaults)."""
    picked: list[tuple[tuple[str, Any], ...]] = [()]
    for option in search_choices():
        if counts(option) == counted:
            values = choices.get(option.name, option.tried())
            picked = [(*p, *option.sets(axes, v).items()) for p in picked for v in values]
    return list(dict.fromkeys(picked))


def _splits(axes: dict[str, int], choices: Choices) -> list[int]:
    mesh = tuple(axes.items())
    return [SearchLayout(mesh, options=p).splits for p in picks(axes, choices, counted=True)]


def layouts(
    devices: int,
    dims: ModelDims,
    batch: tuple[int, int],
    *,
    remat: Sequence[str | None],
    scan: Sequence[bool],
    precision: Sequence[str],
    **choices: Sequence[Any],
) -> list[SearchLayout]:
    """Every valid layout, or a `ShardingError` naming the device counts or batch sizes that would have some.

    ``choices`` are the values of the strategies' search options to try (`search_choices`, by name; the
    option's own defaults where not given): counts first, then remat, scan and precision, then the others.
    """
    rows, seq = batch
    found = list(meshes(devices, dims, seq))
    if not found:
        raise ShardingError(_no_mesh(devices, dims, seq))
    result = []
    for axes in found:
        mesh = tuple((a, axes[a]) for a in mesh_axes())
        scanned = any(a.needs_scan and axes[a.name] > 1 for a in strategy_axes())
        others = picks(axes, choices, counted=False)
        for counted in picks(axes, choices, counted=True):
            if batch_problem(axes, rows, SearchLayout(mesh, options=counted).splits):
                continue
            for r, sc, p, other in itertools.product(remat, scan, precision, others):
                if scanned and not sc:
                    continue  # a pipeline stacks its layers: its program is the scanned one
                result.append(SearchLayout(mesh, r, sc, p, (*counted, *other)))
    if not result:
        raise ShardingError(_no_batch(rows, found, choices) + _other_devices(devices, dims, batch, choices))
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


def _other_devices(devices: int, dims: ModelDims, batch: tuple[int, int], choices: Choices) -> str:
    def works(n: int) -> bool:
        return any(not batch_problem(a, batch[0], k) for a in meshes(n, dims, batch[1]) for k in _splits(a, choices))

    near = [n for n in range(max(1, devices - 16), devices + 17) if n != devices and works(n)]
    closest = sorted(sorted(near, key=lambda n: abs(n - devices))[:4])
    return f"; nearest device counts that split batch {batch[0]}: {closest}"


def _no_batch(rows: int, found: list[dict[str, int]], choices: Choices) -> str:
    splits = sorted({math.prod(a[r] for r in row_axes(a)) * k for a in found for k in _splits(a, choices)})
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
    axes = strategy_axes()
    recompute = {None: 1.0, DEFAULT_POLICY: 4 / 3}.get(layout.remat, 1.1)  # the default recomputes everything
    if layout.remat is None and any(a.recomputes(layout) for a in axes):
        recompute = 4 / 3  # a strategy whose backward replays each layer's forward
    flops = 6 * params * tokens * recompute / math.prod(layout.axes.values())
    idle = sum(a.idle(layout) for a in axes)
    width = compute_width(layout.precision)
    local = width * tokens / math.prod(layout.degree(a) for a in _split_batch(layout))
    layers = (dims.layers or 1) / math.prod(layout.degree(a.name) for a in axes if a.splits_layers)
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
