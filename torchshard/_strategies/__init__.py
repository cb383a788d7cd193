"""The parallel strategies, one folder each (pipeline, context, experts), and their registry: the one place a
strategy registers. Trainer, AbstractTrainer, init_sharded, ``plan --compile``, ``plan --search`` and the command
line read their strategies from `STRATEGIES`; none of them names one.

May import _train and everything below it; no strategy's folder imports another's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchshard._strategies.context import binding as contextual
from torchshard._strategies.experts import binding as dispatched
from torchshard._strategies.pipeline import binding as pipelined
from torchshard._train import fused_loss, kernel_choice
from torchshard._train.strategy import Bound, Setting, Strategy

__all__ = ["STRATEGIES", "bind_all", "flagged", "register"]

# Trainer keyword → strategy, bound in this order (a pipeline lays out its stack before the others see it)
STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Adds ``strategy`` (bound after those before it); its keyword is then a Trainer keyword.

    Raises:
        ValueError: its keyword is taken by another strategy.
    """
    taken = STRATEGIES.get(strategy.keyword)
    if taken is not None and taken != strategy:
        raise ValueError(f"strategy keyword {strategy.keyword!r} is taken by {taken.option.__name__}")
    STRATEGIES[strategy.keyword] = strategy
    return strategy


register(pipelined.STRATEGY)
register(contextual.STRATEGY)
register(dispatched.STRATEGY)
register(fused_loss.STRATEGY)
register(kernel_choice.STRATEGY)


def flagged() -> list[Strategy]:
    """The strategies with a ``plan --compile`` flag, in registry order."""
    return [s for s in STRATEGIES.values() if s.flag is not None]


def bind_all(
    setting: Setting, options: Mapping[str, Any], *, caller: str = "Trainer.__init__", every: bool = True
) -> tuple[dict[str, Bound], Setting]:
    """Every registered strategy (``every=False``: those in ``options``) bound to ``setting`` with the user's
    option for it; the setting as they lay it out.

    Raises:
        TypeError: a keyword no strategy registered (as Python says of ``caller``'s unknown keywords).
        ArgumentError: an option that is not its strategy's type.
        ShardingError: a strategy that does not fit the model, plan or batch spec (with why).
    """
    for keyword in options:
        if keyword not in STRATEGIES:
            raise TypeError(f"{caller}() got an unexpected keyword argument {keyword!r}")
    bound = {}
    for keyword, strategy in STRATEGIES.items():
        if every or keyword in options:
            bound[keyword] = binding = strategy.bind(options.get(keyword), setting)
            setting = binding.rewrite(setting)
    return bound, setting
