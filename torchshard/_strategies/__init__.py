"""The parallel strategies, one folder each (pipeline, context, experts, fused_loss, attention_kernel), and their
registry: the one place a strategy registers. Trainer, AbstractTrainer, init_sharded, ``plan --compile``,
``plan --search`` and the command line read their strategies from `STRATEGIES`; none of them names one.

May import _train and everything below it; no strategy's folder imports another's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torchshard._base.errors import ArgumentError
from torchshard._base.validate import raise_for_arguments
from torchshard._strategies.attention_kernel import binding as kernel
from torchshard._strategies.context import binding as contextual
from torchshard._strategies.experts import binding as dispatched
from torchshard._strategies.fused_loss import binding as fused
from torchshard._strategies.pipeline import binding as pipelined
from torchshard._train.strategy import Bound, Setting, Strategy

__all__ = ["RESERVED", "STRATEGIES", "bind_all", "flagged", "register", "reserve"]

# Trainer keyword → strategy, bound in this order (a pipeline lays out its stack before the others see it)
STRATEGIES: dict[str, Strategy] = {}
# parameter name → the function it belongs to (the Trainer's own keywords), which no strategy may take: see `reserve`
RESERVED: dict[str, str] = {}


def _name(strategy: Strategy) -> str:
    return getattr(strategy.option, "__name__", repr(strategy.option))


def _problems(strategy: Any) -> list[str]:
    """Why ``strategy`` cannot be registered: every problem, each with its fix; empty if none."""
    if not isinstance(strategy, Strategy):
        return [f"register() takes a torchshard._train.strategy.Strategy, got {type(strategy).__name__}"]
    keyword, problems = strategy.keyword, []
    if not (isinstance(keyword, str) and keyword.isidentifier()):
        problems.append(f"strategy keyword {keyword!r} is not a Python identifier; a Trainer keyword must be one")
    elif keyword in RESERVED:
        problems.append(
            f"strategy keyword {keyword!r} of {_name(strategy)} is {RESERVED[keyword]}'s own parameter "
            f"{keyword!r}, so {keyword}= would never reach the strategy; give the strategy another keyword"
        )
    elif (taken := STRATEGIES.get(keyword)) is not None and taken != strategy:
        problems.append(f"strategy keyword {keyword!r} is taken by {_name(taken)}; give the strategy another keyword")
    if not isinstance(strategy.option, type):
        problems.append(f"strategy {keyword!r}: option must be the class its keyword takes, got {strategy.option!r}")
    if not callable(strategy.bind):
        problems.append(
            f"strategy {keyword!r}: bind must be a function bind(option, setting) -> Bound, got {strategy.bind!r:.60}"
        )
    return problems


def register(strategy: Strategy) -> Strategy:
    """Adds ``strategy`` (bound after those before it); its keyword is then a Trainer keyword.

    Raises:
        ArgumentError: every problem at once, before anything is registered: ``strategy`` is no
            `Strategy`; its keyword is no Python identifier, is one of the Trainer's own parameters
            (``plan``, ``donate``, ``seed``, ``remat``...: `RESERVED`) or is taken by another
            strategy; its ``option`` is no class; its ``bind`` is not callable.
    """
    raise_for_arguments(_problems(strategy), header="cannot register the strategy")
    STRATEGIES[strategy.keyword] = strategy
    return strategy


def reserve(function: Callable[..., Any]) -> None:
    """Makes ``function``'s own parameters (the Trainer's, read from its signature) keywords no strategy may take.

    Called where the function is defined; `register` refuses those keywords from then on, and
    strategies registered before are checked here.

    Raises:
        ArgumentError: a registered strategy takes one of the parameters.
    """
    owner, kinds = function.__name__, (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    names = [n for n, p in inspect.signature(function).parameters.items() if p.kind not in kinds]
    problems = [
        f"strategy keyword {n!r} of {_name(STRATEGIES[n])} is {owner}'s own parameter {n!r}; "
        f"give the strategy another keyword"
        for n in names
        if n in STRATEGIES
    ]
    raise_for_arguments(problems, header=f"strategies shadow {owner}'s parameters")
    RESERVED.update(dict.fromkeys(names, owner))


register(pipelined.STRATEGY)
register(contextual.STRATEGY)
register(dispatched.STRATEGY)
register(fused.STRATEGY)
register(kernel.STRATEGY)


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
        ArgumentError: an option that is not its strategy's type; a ``bind`` that returned no `Bound`.
        ShardingError: a strategy that does not fit the model, plan or batch spec (with why).
    """
    for keyword in options:
        if keyword not in STRATEGIES:
            raise TypeError(f"{caller}() got an unexpected keyword argument {keyword!r}")
    bound = {}
    for keyword, strategy in STRATEGIES.items():
        if every or keyword in options:
            bound[keyword] = binding = strategy.bind(options.get(keyword), setting)
            if not isinstance(binding, Bound):
                raise ArgumentError(
                    f"strategy {keyword!r} ({_name(strategy)}): bind(option, setting) returned {binding!r:.60} "
                    f"({type(binding).__name__}), not a Bound; return Bound() for a None option, else a Bound subclass"
                )
            setting = binding.rewrite(setting)
    return bound, setting
