"""The plan search's compiles: a candidate layout's step built as an AbstractTrainer, compiled, its costs read."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import optax
import torch

from torchshard._base.errors import ShardingError
from torchshard._hlo.costs import StepCosts, step_costs
from torchshard._hlo.hardware import Hardware
from torchshard._hlo.hlo import axes_of
from torchshard._hlo.memory import CompiledMemory
from torchshard._presets.hf import hf_rules
from torchshard._presets.tables import common_tensor_parallel, fsdp
from torchshard._search.space import DATA, MODEL, ModelDims, SearchLayout, row_axes, strategy_axes
from torchshard._sharding.mesh import make_mesh
from torchshard._sharding.plan import ShardingPlan, plan
from torchshard._strategies import STRATEGIES
from torchshard._train.precision import named_policy
from torchshard._train.remat import Remat
from torchshard._train.search_seam import GRAD_ACCUM
from torchshard._trainer.abstract import AbstractTrainer

Compiled = tuple[int, StepCosts]  # peak bytes per device, costs
_CACHE: dict[tuple[Any, ...], Compiled] = {}  # one compile per program, reused across searches in a process
# The search reads a compiled step's HLO and buffer assignment, never runs it: without LLVM's
# optimisation XLA emits the same optimised HLO, the same buffers and the same peak (the same text,
# byte for byte: tests/test_search.py) and compiles 1.3-2x faster (8B at 64 devices: 7.5 -> 5.9 s,
# data=16,context=4: 18.8 -> 8.8 s). XLA's older CPU fusion emitters would compile faster still
# but fuse differently, which changes the bytes accessed the estimate reads (50x on 8B), so not those.
FAST_COMPILE: dict[str, Any] = {"xla_backend_optimization_level": 0}  # jax types it str | bool; XLA takes ints


@dataclasses.dataclass(frozen=True)
class Problem:
    """What the search is for: the model (built on meta), the batch, the devices and the hardware."""

    model: torch.nn.Module
    batch: tuple[int, int]
    devices: int
    hw: Hardware
    device_memory: int
    devices_per_host: int
    loss_fn: Callable[..., Any]

    @property
    def tokens(self) -> int:
        return self.batch[0] * self.batch[1]


def _stack_name(model: torch.nn.Module) -> str:
    lists = [(len(m), n) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and n]
    if not lists:
        raise ShardingError(f"{type(model).__name__} has no ModuleList of layers to remat, scan or pipeline")
    return max(lists)[1]


def at_depth(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """The same transformers model with ``layers`` decoder layers, built on ``meta``."""
    config: Any = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = (config.layer_types * layers)[:layers]
    with torch.device("meta"):
        return type(model)(config)


def _rules(model: torch.nn.Module, layout: SearchLayout) -> Any:
    tp = MODEL if layout.degree(MODEL) > 1 else None
    if getattr(model, "config", None) is not None:
        placed: dict[str, Any] = {
            a.plan_keyword: a.name for a in strategy_axes() if a.plan_keyword and layout.degree(a.name) > 1
        }
        return hf_rules(model, axis=tp, fsdp_axis=DATA, **placed)
    return (common_tensor_parallel(axis=MODEL) + fsdp(DATA)) if tp else fsdp(DATA)


def trainer_options(model: torch.nn.Module | None, layout: SearchLayout) -> dict[str, Any]:
    """The Trainer keywords of a candidate: batch spec, accumulation, each strategy's option, remat, scan, precision."""
    rows = row_axes(layout.axes)
    sequence = [a.name for a in strategy_axes() if a.batch_dim == 1 and layout.degree(a.name) > 1]
    return {
        "batch_spec": (rows[0] if len(rows) == 1 else tuple(rows), *sequence),
        GRAD_ACCUM: layout.option(GRAD_ACCUM, 1),
        **{s.keyword: s.searched(layout) for s in STRATEGIES.values() if s.searched},
        "remat": Remat(rf"{re.escape(_stack_name(model))}\.\d+", policy=layout.remat)
        if layout.remat and model is not None
        else None,
        "scan_layers": layout.scan,
        "precision": named_policy(layout.precision),
    }


def _mesh(layout: SearchLayout, devices: list[Any]) -> Any:
    axes = {a: n for a, n in layout.mesh if n > 1 or a == DATA}
    return make_mesh(axes, devices=devices[: math.prod(axes.values())])


def layout_plan(model: torch.nn.Module, layout: SearchLayout, devices: list[Any]) -> ShardingPlan:
    """The candidate's plan on the first of ``devices``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unused tp_plan entries: the plan is still the model's
        return plan(model, _mesh(layout, devices), _rules(model, layout))


def compile_layout(problem: Problem, layout: SearchLayout, model: torch.nn.Module, devices: list[Any]) -> Compiled:
    """Compiles ``model``'s step under ``layout``; its peak bytes per device and its costs (cached)."""
    key = (id(problem.model), layout, sum(1 for _ in model.parameters()), problem.batch, problem.loss_fn)
    if key in _CACHE:
        return _CACHE[key]
    planned = layout_plan(model, layout, devices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = AbstractTrainer(model, problem.loss_fn, optax.adamw(1e-4), planned, **trainer_options(model, layout))
        batch = torch.empty(problem.batch, dtype=torch.int64, device="meta")
        compiled = trainer.lower(batch).compile(FAST_COMPILE)
    costs = step_costs(str(compiled.as_text()))
    mesh = planned.mesh
    ops = tuple((dataclasses.replace(op, axes=axes_of(op, mesh)), n) for op, n in costs.collectives)  # type: ignore[arg-type]
    _CACHE[key] = (CompiledMemory.of(compiled).peak_bytes, dataclasses.replace(costs, collectives=ops))
    return _CACHE[key]


def measure(problem: Problem, layout: SearchLayout, devices: list[Any]) -> Compiled:
    """Peak and costs at full depth: compiled at full depth when scanned or pipelined (compile time does not
    grow with depth), else at 1 and 2 layers and extrapolated linearly (every layer costs the same)."""
    model, layers = problem.model, ModelDims.of(problem.model).layers
    if layout.scan or layers is None or layers <= 2 or getattr(model, "config", None) is None:
        return compile_layout(problem, layout, model, devices)
    (p1, c1), (p2, c2) = (compile_layout(problem, layout, at_depth(model, n), devices) for n in (1, 2))
    return round(p1 + (layers - 1) * (p2 - p1)), c1.scaled(c2, layers - 1)


def cache_clear() -> None:
    """Forgets every compiled program (tests)."""
    _CACHE.clear()
    jax.clear_caches()
