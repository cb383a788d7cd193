"""The context-parallel strategy: a `ContextParallel` checked against the mesh and batch spec, and its trace context."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from torchshard._parallel.context import ContextParallel, check_context, sequence_problems, tracing
from torchshard._train.strategy import Bound, Setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contextual(Bound):
    """Batch leaves' sequences split over the context axis; every SDPA traced as context-parallel attention."""

    option: ContextParallel
    mesh: Mesh

    def batch_problems(self, what: str, shape: Sequence[int]) -> list[str]:
        return sequence_problems(self.option, self.mesh, what, shape)

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        return tracing(self.option, self.mesh)


def bind(context: Any, setting: Setting) -> Bound:
    """``Trainer(context=)``.

    Raises:
        ArgumentError: ``context`` is not a `ContextParallel`.
        ShardingError: its axis is not in the mesh, or ``batch_spec`` does not split dim 1 over it.
    """
    check_context(context, setting.plan.mesh, setting.batch_spec)
    if context is None:
        return Bound()
    assert isinstance(setting.plan.mesh, Mesh)  # checked with the other Trainer arguments
    return Contextual(option=context, mesh=setting.plan.mesh)
