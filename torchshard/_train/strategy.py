"""The strategy seam: what a parallel strategy binds to, and what a bound strategy gives the Trainer and its step.

A strategy is one `Strategy` (registered in ``_strategies/__init__.py``, or by anyone with
``register``): its Trainer keyword, its option's type and a function ``bind(option, setting) ->
Bound``. ``option`` is what the user passed for its Trainer keyword (``None`` included),
``setting`` what it binds to. It checks its arguments there (raising `ArgumentError` /
`ShardingError` before anything moves) and returns a `Bound` whose methods the Trainer calls in
turn for every strategy; the defaults contribute nothing. How it runs: its ``rewrite`` may hand a
scanned stack a `StackRunner` (the execution hook the step calls instead of ``lax.scan``).
A `Flag` makes it a ``plan --compile`` option, ``searched`` a ``plan --search`` one (the search's part of the seam:
``search_seam``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._base.validate import spec_problems
from torchshard._sharding.plan import ShardingPlan
from torchshard._sharding.process import global_shape
from torchshard._train.batching import BatchLayout
from torchshard._train.scan import ScanGroup
from torchshard._train.search_seam import SearchAxis, SearchedLayout, SearchOption


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a strategy binds to: the model, its plan, the batch spec and the layer groups the step scans."""

    model: torch.nn.Module
    plan: ShardingPlan
    batch_spec: PartitionSpec
    groups: tuple[ScanGroup, ...] = ()


def where(setting: Setting) -> tuple[str, int]:
    """The platform the plan's mesh is on and its number of devices (a plan without a mesh: one CPU), which the
    kernels a strategy chooses depend on."""
    mesh = setting.plan.mesh
    device = mesh.devices.flat[0] if isinstance(mesh, Mesh) else None
    platform = device.platform if device is not None else "cpu"
    return platform, mesh.devices.size if isinstance(mesh, Mesh) else 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bound:
    """A strategy bound to a `Setting`. Subclasses (keyword-only dataclasses) override what their strategy adds."""

    option: Any = None  # what the Trainer reports for the strategy's keyword (resolved, e.g. a default)

    def rewrite(self, setting: Setting) -> Setting:
        """The setting as this strategy lays it out (a pipeline stores its stack stage by stage)."""
        return setting

    def rows(self) -> tuple[str, int]:
        """What every batch's rows must split into for this strategy: (its name in messages, the factor)."""
        return "", 1

    def batch_problems(self, what: str, shape: Sequence[int]) -> list[str]:
        """Why a batch leaf of ``shape`` (named ``what``) cannot go through this strategy."""
        return []

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around every trace of the model (e.g. attention lowered as ring attention)."""
        return contextlib.nullcontext()

    def gradient(self) -> Callable[[Any], Callable[..., Any]] | None:
        """The step's value_and_grad of the loss, from its `Runtime`, if this strategy differentiates it itself."""
        return None

    def kernels(self) -> Mapping[str, Any]:
        """The kernel each attention call site this strategy lowers got, and why (after the step is traced)."""
        return {}

    @property
    def idle_fraction(self) -> float:
        """The fraction of the devices' time this strategy leaves idle (a pipeline's bubble)."""
        return 0.0


Binder = Callable[[Any, Setting], Bound]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flag:
    """A strategy's ``python -m torchshard plan --compile`` flag, ``--KEYWORD`` (underscores as dashes)."""

    metavar: str
    help: str
    parse: Callable[[str, dict[str, int]], Any]  # (the flag's text, the --mesh axes) → the option; ValueError if bad
    figures: Callable[[Any, Any], dict[str, Any]]  # (option, the AbstractTrainer) → the report's JSON figures
    summary: Callable[[dict[str, Any]], str]  # the figures → the report's options line's words, e.g. ", pipeline ..."


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """Everything about one parallel strategy: ``Trainer(keyword=option)``, bound by ``bind``.

    ``lays_out``: its rewrite stores layers differently, so ``init_sharded(keyword=option)`` builds
    them that way. ``flag``: its ``plan --compile`` flag. ``searched``: the option a ``plan
    --search`` candidate gives it, from the candidate's `SearchedLayout` (None: off); ``axis``: the
    mesh axis the search lays out for it, and how it splits and costs (`SearchAxis`);
    ``search_options``: what else the search varies for it, each a `search` keyword and a ``plan
    --search`` flag (`SearchOption`).

    ``register`` refuses (one `ArgumentError` listing every problem) a keyword that is no Python
    identifier, one of the Trainer's own parameters (``plan``, ``donate``, ``seed``, ``remat``...)
    or another strategy's; an ``option`` that is no class; a ``bind`` that is not callable. A
    ``bind`` that returns anything but a `Bound` is an `ArgumentError` when the Trainer is built.
    """

    keyword: str
    option: type
    bind: Binder
    lays_out: bool = False
    flag: Flag | None = None
    searched: Callable[[SearchedLayout], Any] | None = None
    axis: SearchAxis | None = None
    search_options: tuple[SearchOption, ...] = ()


def row_factor(grad_accum_steps: int, bound: Sequence[Bound]) -> tuple[str, int]:
    """What a batch's rows must split into: grad_accum_steps micro-batches, each as every strategy needs.

    Examples:
        >>> row_factor(2, [])
        ('grad_accum_steps', 2)
    """
    factors = [("grad_accum_steps", grad_accum_steps), *(b.rows() for b in bound)]
    factors = [(name, n) for name, n in factors if n > 1] or [("grad_accum_steps", 1)]
    total = 1
    for _, n in factors:
        total *= n
    return " × ".join(name for name, _ in factors), total


def leaf_problems(
    layout: BatchLayout, bound: Sequence[Bound], steps: int, index: int, leaf: Any, *, local: bool = False
) -> list[str]:
    """Why batch leaf ``index`` cannot be placed by ``layout`` and split into ``steps`` micro-batches for ``bound``.

    With ``local``, ``leaf`` is this process's part of the global leaf.
    """
    shape, what, sharding = tuple(np.shape(leaf)), f"batch leaf #{index}", layout.sharding(leaf)
    if local:
        shape, problems = global_shape(shape, sharding, what=f"process-local {what}")
        if problems:
            return problems
    if problems := [p for strategy in bound for p in strategy.batch_problems(what, shape)]:
        return problems
    factors = {0: row_factor(steps, bound)} if shape else {}
    return spec_problems(
        what,
        shape,
        sharding.spec,
        layout.mesh,
        factors=factors,
        fix=lambda multiple: f"use a batch size that is a multiple of {multiple}",
    )


def tracing_all(bound: Sequence[Bound]) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """One context manager entering every strategy's trace-time context, in order."""

    @contextlib.contextmanager
    def entered():
        with contextlib.ExitStack() as stack:
            for strategy in bound:
                stack.enter_context(strategy.tracing())
            yield

    return entered


def gradient_of(bound: Sequence[Bound]) -> Callable[[Any], Callable[..., Any]] | None:
    """The value_and_grad the step uses: a strategy's own (a 1F1B pipeline's), else None (autodiff of the loss)."""
    return next((g for strategy in bound if (g := strategy.gradient()) is not None), None)
