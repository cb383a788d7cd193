"""Which plan? Enumerate meshes and options for a model, prune, compile the survivors, rank by estimated time."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchshard._base.errors import ArgumentError, ShardingError
from torchshard._base.format import fmt_bytes
from torchshard._base.validate import int_problems, raise_for_arguments
from torchshard._hlo.costs import StepCosts
from torchshard._hlo.hardware import Hardware, hardware
from torchshard._report.fit import lm_loss, simulated_devices
from torchshard._report.memory import training_memory
from torchshard._search import compile_worker, search_compile
from torchshard._search.compile_worker import CompileFailed, Compiler
from torchshard._search.estimate import estimate
from torchshard._search.search_compile import (  # noqa: F401  (re-exported: tests and benchmarks use them)
    FAST_COMPILE,
    Problem,
    at_depth,
    compile_layout,
    layout_plan,
    measure,
    trainer_options,
)
from torchshard._search.space import (
    ModelDims,
    SearchLayout,
    allowed,
    analytic_seconds,
    choice_values,
    counts,
    dimensions,
    layouts,
    search_choices,
    strategy_axes,
)
from torchshard._strategies import STRATEGIES
from torchshard._train.precision import master_dtype
from torchshard._train.remat import DEFAULT_POLICY
from torchshard._train.search_seam import GRAD_ACCUM

log = logging.getLogger(__name__)
REMATS = (None, DEFAULT_POLICY, "dots_saveable")  # the remat policies a search tries by default (None: no remat)
Progress = Callable[[int, int, str], None]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration the search considered, with its compiled memory and estimated speed.

    Attributes:
        layout: mesh degrees and Trainer options (see ``options``).
        peak_bytes: the compiled step's peak per device (None: not compiled).
        fits: ``peak_bytes <= device_memory`` (None: not compiled).
        step_seconds, tokens_per_second, mfu: the estimate on the hardware profile (None: not compiled).
        dominant: the largest part of the estimate (``compute``, ``memory``, ``comm model``, ...).
        parts: seconds per part.
        note: why it was not compiled or failed, if so.
    """

    layout: SearchLayout
    peak_bytes: int | None = None
    fits: bool | None = None
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    dominant: str = ""
    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    note: str = ""

    @property
    def mesh(self) -> dict[str, int]:
        """The mesh axes of size > 1 (``data`` always), in mesh order."""
        return {a: n for a, n in self.layout.mesh if n > 1 or a == "data"}

    @property
    def options(self) -> dict[str, Any]:
        """The Trainer options: each strategy's (by keyword, its option's fields, or None), grad accumulation where
        no strategy takes the micro-batches, remat policy, scan, precision."""
        lay = self.layout
        given = trainer_options(None, lay)
        strategies = {k: _fields(v) for k, v in given.items() if k in STRATEGIES}
        return {
            **strategies,
            GRAD_ACCUM: given[GRAD_ACCUM],
            "remat": lay.remat,
            "scan_layers": lay.scan,
            "precision": lay.precision,
        }

    def to_json(self) -> dict[str, Any]:
        """The candidate as JSON-ready data."""
        return {
            "mesh": self.mesh,
            "options": self.options,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "dominant": self.dominant,
            "parts": self.parts,
            "note": self.note,
        }


def _fields(option: Any) -> Any:
    """A strategy's option as JSON-ready data: a dataclass's fields, else the value (None: off)."""
    if dataclasses.is_dataclass(option) and not isinstance(option, type):
        return dataclasses.asdict(option)
    return option


def model_flops(model: torch.nn.Module, tokens: int, seq: int) -> float:
    """Training FLOPs of a step as torchtitan counts them: 6 × non-embedding params + 12 × L × hidden × seq."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    params -= embed.weight.numel() if embed is not None else 0
    dims = ModelDims.of(model)
    attention = 12 * (dims.layers or 0) * (dims.hidden or 0) * seq
    return float((6 * params + attention) * tokens)


def rate(problem: Problem, layout: SearchLayout, peak: int, costs: StepCosts) -> Candidate:
    """The candidate's verdict and speed on the problem's hardware."""
    bubble = sum(axis.idle(layout) for axis in strategy_axes())
    est = estimate(
        costs, problem.hw, precision=layout.precision, devices_per_host=problem.devices_per_host, bubble=bubble
    )
    flops = model_flops(problem.model, problem.tokens, problem.batch[1])
    mfu = flops / (est.seconds * problem.devices * problem.hw.bf16_flops)
    return Candidate(
        layout,
        peak,
        peak <= problem.device_memory,
        est.seconds,
        problem.tokens / est.seconds,
        mfu,
        est.dominant,
        {k: round(v, 6) for k, v in est.parts.items()},
    )


def _rough(problem: Problem, layout: SearchLayout) -> float:
    params = sum(p.numel() for p in problem.model.parameters())
    hw = problem.hw
    return analytic_seconds(
        layout, ModelDims.of(problem.model), params, problem.batch, hw.bf16_flops, hw.intra_host_bandwidth
    )


def _state_note(problem: Problem, layout: SearchLayout, devices: list[Any]) -> str:
    try:
        planned = layout_plan(problem.model, layout, devices)
    except ShardingError as err:
        return f"no plan: {str(err).splitlines()[-1].strip()}"
    state = training_memory(planned, problem.model, param_dtype=master_dtype(layout.precision)).total
    return f"params + grads + AdamW alone need {fmt_bytes(state)}" if state > problem.device_memory else ""


def _base(group: list[SearchLayout], options: dict[str, Any]) -> SearchLayout:
    """A mesh's first layout to compile: full remat, scanned, bf16, the fewest micro-batches, then what each
    search choice prefers (`SearchOption.prefer`: what fits most)."""
    remat, precision = _first(options["remat"], DEFAULT_POLICY), _first(options["precision"], "bf16")
    preferring = [(o.name, o.prefer) for o in search_choices() if o.prefer is not None]

    def prefer(lay: SearchLayout) -> tuple[Any, ...]:
        own = tuple(key(lay, options.get(name, ())) for name, key in preferring)
        return (lay.remat != remat, not lay.scan, lay.precision != precision, lay.splits, *own)

    return min(group, key=prefer)


def _first(values: Sequence[Any], wanted: Any) -> Any:
    return wanted if wanted in values else values[0]


class _Runner:
    """Compiles layouts within a budget, remembering each verdict (a failed compile is one, the search goes on)."""

    def __init__(self, problem: Problem, budget: int, progress: Progress | None, compiler: Compiler) -> None:
        self.problem, self.budget, self.progress, self.compiler = problem, budget, progress, compiler
        self.devices = compiler.devices
        self.done: dict[SearchLayout, Candidate] = {}
        self.notes: dict[SearchLayout, str] = {}  # why a mesh's first layout was not compiled

    def __call__(self, layout: SearchLayout) -> Candidate:
        if layout not in self.done:
            if self.progress is not None:
                self.progress(len(self.done), self.budget, layout.label())
            try:
                self.done[layout] = rate(self.problem, layout, *self.compiler.measure(layout))
            except ShardingError as err:
                self.done[layout] = Candidate(layout, note=f"cannot compile: {str(err).splitlines()[0]}")
            except CompileFailed as err:
                log.warning("plan search: %s failed to compile: %s", layout.label(), err)
                self.done[layout] = Candidate(layout, note=f"failed: {err}")
        return self.done[layout]

    @property
    def left(self) -> int:
        return self.budget - len(self.done)


def _better(a: Candidate, b: Candidate | None) -> bool:
    return b is None or _rank(a) < _rank(b)


def refine(run: _Runner, group: list[SearchLayout], start: Candidate) -> None:
    """Coordinate search from ``start``: each option in turn (`dimensions`) tried at every value with the others
    at the best so far."""
    best, dims = start, dimensions()
    for varied in dims:
        for layout in group:
            others = all(d(layout) == d(best.layout) for d in dims if d is not varied)
            if others and layout != best.layout and run.left > 0:
                tried = run(layout)
                best = tried if _better(tried, best) and tried.fits else best


def run_search(
    problem: Problem, options: dict[str, Any], *, max_compiles: int, refine_meshes: int, progress: Progress | None
) -> list[Candidate]:
    """Every layout, ranked: meshes first compiled once each (in order of a rough estimate, half the budget),
    then the best ``refine_meshes`` that fit refined option by option; fitting ones by estimated time first."""
    found = layouts(problem.devices, ModelDims.of(problem.model), problem.batch, **options)
    with Compiler(problem, simulated_devices(problem.devices)) as compiler:
        run = _Runner(problem, max_compiles, progress, compiler)
        _explore(run, found, options, refine_meshes)
    if progress is not None:
        progress(run.budget, run.budget, "done")
    rest = [
        Candidate(lay, note=run.notes.get(lay) or "not compiled: its mesh ranked below the ones explored")
        for lay in found
        if lay not in run.done
    ]
    return sorted([*run.done.values(), *rest], key=_rank)


def _explore(run: _Runner, found: list[SearchLayout], options: dict[str, Any], refine_meshes: int) -> None:
    problem, max_compiles = run.problem, run.budget
    groups: dict[tuple[tuple[str, int], ...], list[SearchLayout]] = {}
    for layout in found:
        groups.setdefault(layout.mesh, []).append(layout)
    bases = sorted((_base(g, options) for g in groups.values()), key=lambda lay: _rough(problem, lay))
    for layout in bases:
        run.notes[layout] = _state_note(problem, layout, run.devices)
        if not run.notes[layout] and len(run.done) < max(max_compiles // 2, 1):
            run(layout)
    fitting = sorted((c for c in run.done.values() if c.fits), key=_rank)[:refine_meshes]
    for start in fitting:
        refine(run, groups[start.layout.mesh], start)


def _rank(c: Candidate) -> tuple[int, float]:
    if c.fits:
        return (0, c.step_seconds or 0.0)
    return (1, c.step_seconds or math.inf) if c.step_seconds is not None else (2, 0.0)


def search(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    *,
    devices: int,
    batch: tuple[int, int],
    hardware_name: str | Hardware = "h100",
    device_memory: int | None = None,
    hosts: int | None = None,
    loss_fn: Callable[..., Any] | None = None,
    remat: Sequence[str | None] = REMATS,
    scan: Sequence[bool] = (True, False),
    precision: Sequence[str] = ("bf16", "fp32"),
    max_compiles: int = 20,
    refine_meshes: int = 3,
    progress: Progress | None = None,
    **choices: Sequence[Any],
) -> list[Candidate]:
    """Searches meshes and Trainer options for ``model`` on ``devices`` devices; the best first.

    Enumerates the mesh degrees (data, model and each strategy's axis: stage, context, expert) that
    divide the model's head counts, layers, experts and the sequence, with remat policies, scan, precision
    and what the strategies vary (``choices``); drops those whose plan's state alone
    cannot fit; compiles the rest (in order of a rough estimate, at most ``max_compiles``) with an
    `AbstractTrainer` on simulated devices; and ranks the ones that fit by the step time estimated
    from the compiled FLOPs, memory traffic and collectives over ``hardware_name``'s profile.

    Args:
        model: a model built on ``meta`` (or a factory of one); transformers models are rebuilt at
            1 and 2 layers for unscanned candidates, whose costs are extrapolated to the full depth.
        devices: the device count; JAX must not have started with fewer (``use_cpu_devices``).
        batch: ``(rows, sequence)`` of int64 token ids.
        hardware_name: a profile name (``h100``, ``a100``, ``tpu-v5p``, ``tpu-v5e``) or a `Hardware`.
        device_memory: bytes per device (default: the profile's).
        hosts: hosts the devices span (default: the profile's devices per host decides).
        loss_fn: ``loss_fn(model, ids)`` (default: a causal LM's own loss).
        remat: the remat policies to enumerate.
        scan: the scan settings to enumerate.
        precision: the precisions to enumerate.
        max_compiles: layouts compiled at most: half of them the meshes' first layouts (in order of a
            rough analytic estimate), the rest refining the best ``refine_meshes`` meshes that fit.
        refine_meshes: how many of the best fitting meshes get their options searched one at a time.
        progress: called with (done, total, what) before each candidate.
        **choices: the values to try for each registered strategy's search options (`search_choices`, by
            `SearchOption.name`; each defaults to the option's own, and ``python -m torchshard plan --help``
            lists them as ``plan --search`` flags): a pipeline's micro-batch counts (gradient accumulation
            off stage meshes) and schedules (a mesh is compiled first with the one that fits most).

    Compiles run in a child process (started once, reused, replaced if it dies): a candidate whose
    compile raises, or kills the process as a fatal XLA check does, gets ``note`` ``"failed:
    <reason>"`` and the search goes on. A model or loss pickle cannot send (a lambda) is compiled
    in this process instead (a warning says so), where an abort would end the search.

    Returns:
        Every `Candidate`: fitting ones by estimated step time, then those that do not fit, then the rest
        (failed ones among them, by their ``note``).

    Raises:
        TypeError: a keyword no strategy's search option takes.
        ArgumentError: an unknown hardware name (the known ones listed); ``devices``, ``hosts``,
            ``device_memory`` or a count of a choice that is not a positive int, or hosts that do not
            divide the devices (every problem at once, before anything is built); a choice's value it
            does not take (the ones it does listed).
        ShardingError: no mesh of ``devices`` fits the model, or no layout splits the batch (the
            nearest device counts or batch sizes named).

    Examples:
        >>> import transformers
        >>> config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, use_cache=False)
        >>> with torch.device("meta"):
        ...     model = transformers.LlamaForCausalLM(config)
        >>> best = search(model, devices=2, batch=(4, 16), remat=(None,), scan=(True,), precision=("bf16",),
        ...               microbatches=(1,), max_compiles=1)[0]
        >>> best.fits, best.step_seconds > 0
        (True, True)
    """
    values = choice_values(choices)
    raise_for_arguments(_count_problems(devices, device_memory, hosts, values), header="invalid search arguments")
    hw = hardware(hardware_name)
    if not isinstance(model, torch.nn.Module):
        with torch.device("meta"):
            model = model()
    per_host = devices // hosts if hosts else min(hw.devices_per_host, devices)
    problem = Problem(
        model,
        tuple(batch),  # type: ignore[arg-type]
        devices,
        hw,
        hw.memory_bytes if device_memory is None else device_memory,
        max(per_host, 1),
        loss_fn or lm_loss,
    )
    for option in search_choices():
        given, takes = values[option.name], allowed(option)
        if takes is not None and (not given or any(v not in takes for v in given)):
            raise ArgumentError(f"search: {option.name}={list(given)!r}: choose one or more of {list(takes)}")
    options = {"remat": remat, "scan": scan, "precision": precision, **values}
    return run_search(problem, options, max_compiles=max_compiles, refine_meshes=refine_meshes, progress=progress)


def _count_problems(devices: Any, device_memory: Any, hosts: Any, values: dict[str, Any]) -> list[str]:
    """Why the counts ``search`` takes cannot be searched over (a zero device memory or micro-batch count...)."""
    problems = int_problems("devices", devices, minimum=1) + int_problems("hosts", hosts, minimum=1, none="by profile")
    problems += int_problems("device_memory", device_memory, minimum=1, none="the profile's")
    if not problems and hosts is not None and devices % hosts:
        divisors = [n for n in range(1, devices + 1) if devices % n == 0]
        problems.append(f"hosts={hosts} does not divide devices={devices}; give one of {divisors}")
    for name in (o.name for o in search_choices() if counts(o)):
        given = values[name]
        if not given or isinstance(given, str | int):
            problems.append(f"{name}={given!r} must be a non-empty sequence of ints ≥ 1, e.g. (1, 2, 4)")
        else:
            problems += [p for m in given for p in int_problems(f"each {name}", m, minimum=1)]
    return problems


def cache_clear() -> None:
    """Forgets every compiled program and measurement (tests)."""
    search_compile.cache_clear()
    compile_worker.forget()
