"""The context-parallel strategy: a `ContextParallel` bound to the model, mesh and batch spec, and its trace context."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from torchshard._base.errors import raise_if_any
from torchshard._base.specs import entry_axes
from torchshard._strategies.context.context import model_problems, sequence_problems, tracing
from torchshard._strategies.context.option import ContextParallel, check_context
from torchshard._strategies.context.search import AXIS, searched
from torchshard._train.strategy import Bound, Setting, Strategy


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contextual(Bound):
    """Batch leaves' sequences split over the context axis; every SDPA traced as context-parallel attention."""

    option: ContextParallel
    mesh: Mesh
    row_axes: tuple[str, ...] = ()  # the batch_spec's axes for dim 0 (the rows)
    model: Any = dataclasses.field(default=None, compare=False, repr=False)  # named if it calls no SDPA

    def batch_problems(self, what: str, shape: Sequence[int]) -> list[str]:
        return sequence_problems(self.option, self.mesh, what, shape)

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        return tracing(self.option, self.mesh, self.row_axes, self.model)


def bind(context: Any, setting: Setting) -> Bound:
    """``Trainer(context=)``.

    Raises:
        ArgumentError: ``context`` is not a `ContextParallel`.
        ShardingError: its axis is not in the mesh, ``batch_spec`` does not split dim 1 over it, or the model
            has a sparse-attention indexer (which it cannot split).
    """
    check_context(context, setting.plan.mesh, setting.batch_spec)
    raise_if_any(model_problems(context, setting.model), header=f"{context} does not fit the model")
    if context is None:
        return Bound()
    assert isinstance(setting.plan.mesh, Mesh)  # checked with the other Trainer arguments
    rows = entry_axes(setting.batch_spec[0]) if len(setting.batch_spec) else ()
    return Contextual(option=context, mesh=setting.plan.mesh, row_axes=tuple(rows), model=setting.model)


STRATEGY = Strategy(keyword="context", option=ContextParallel, bind=bind, searched=searched, axis=AXIS)
