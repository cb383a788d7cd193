"""The expert-dispatch strategy: which experts modules move tokens by all-to-all, and its trace context."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from jax.sharding import Mesh

from torchshard._strategies.experts.all_to_all import dispatching
from torchshard._strategies.experts.experts import Experts, expert_dispatch_for
from torchshard._strategies.experts.option import ExpertDispatch
from torchshard._strategies.experts.search import AXIS
from torchshard._train.strategy import Bound, Setting, Strategy


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dispatched(Bound):
    """While the step is traced, these experts modules receive their tokens by all-to-all."""

    option: ExpertDispatch | None
    mesh: Mesh
    experts: tuple[Experts, ...] = ()

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        if not self.experts or self.option is None:
            return contextlib.nullcontext()
        return dispatching(self.option, self.mesh, self.experts)


def bind(dispatch: Any, setting: Setting) -> Bound:
    """``Trainer(expert_dispatch=)``: ``None`` is all-to-all where it can run and the plan's sharding elsewhere.

    Raises:
        ArgumentError: ``dispatch`` is not an `ExpertDispatch`.
        ShardingError: an explicit all-to-all dispatch cannot run (with why).
    """
    resolved, experts = expert_dispatch_for(setting.model, setting.plan, setting.batch_spec, dispatch)
    assert isinstance(setting.plan.mesh, Mesh)  # checked with the other Trainer arguments
    return Dispatched(option=resolved, mesh=setting.plan.mesh, experts=tuple(experts))


STRATEGY = Strategy(keyword="expert_dispatch", option=ExpertDispatch, bind=bind, axis=AXIS)
