"""Every parallel strategy a Trainer takes, by keyword: the one place a new strategy registers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchshard._parallel.context import ContextParallel
from torchshard._parallel.experts import ExpertDispatch
from torchshard._parallel.pipeline import Pipeline
from torchshard._train import contextual, dispatched, pipelined
from torchshard._train.strategy import Binder, Bound, Setting

__all__ = ["STRATEGIES", "ContextParallel", "ExpertDispatch", "Pipeline", "bind_all"]

# Trainer keyword → binder, bound in this order (a pipeline lays out its stack before the others see it)
STRATEGIES: dict[str, Binder] = {
    "pipeline": pipelined.bind,
    "context": contextual.bind,
    "expert_dispatch": dispatched.bind,
}


def bind_all(setting: Setting, options: Mapping[str, Any]) -> tuple[dict[str, Bound], Setting]:
    """Every registered strategy bound to ``setting`` with the user's option for it; the setting as they lay it out.

    Raises:
        ArgumentError: an option that is not its strategy's type.
        ShardingError: a strategy that does not fit the model, plan or batch spec (with why).
    """
    unknown = sorted(set(options) - set(STRATEGIES))
    assert not unknown, f"no strategy registered for {unknown}"
    bound = {}
    for keyword, binder in STRATEGIES.items():
        bound[keyword] = strategy = binder(options.get(keyword), setting)
        setting = strategy.rewrite(setting)
    return bound, setting
