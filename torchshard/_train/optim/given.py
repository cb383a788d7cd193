"""A Trainer's ``optimizer`` argument as its step applies it: an optax transformation as given, or a torch optimizer
translated (`transform.translate`), whose param groups are read before every step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import optax
import torch

from torchshard._sharding.plan import ShardingPlan
from torchshard._train.optim.transform import Translation, translate
from torchshard._train.state import StateLayout, TrainState


@dataclasses.dataclass(frozen=True, eq=False)
class GivenOptimizer:
    """The optax transformation a step applies, and the torch optimizer it was translated from (None for optax)."""

    transform: optax.GradientTransformation
    optimizer: torch.optim.Optimizer | None = None
    translation: Translation | None = None
    names: tuple[tuple[str, ...], ...] = ()  # each torch param group's parameters by name in the model
    # each of those names → (the train-state key holding it, its index in a scanned stack or None)
    keys: Mapping[str, tuple[str, int | None]] = dataclasses.field(default_factory=dict)

    def refresh(self, state: TrainState) -> TrainState:
        """``state`` with every group's hyperparameters as the torch optimizer holds them now (optax: as it is)."""
        return state if self.translation is None else self.translation.refresh(state)

    def settle(self, model: torch.nn.Module) -> None:
        """Points the torch optimizer's groups at ``model``'s placed parameters and drops the host copies of its
        state, which the train state now holds: nothing keeps the model's original CPU tensors alive."""
        if self.optimizer is None:
            return
        placed = dict(model.named_parameters())
        for group, names in zip(self.optimizer.param_groups, self.names, strict=True):
            group["params"] = [placed.get(n, p) for n, p in zip(names, group["params"], strict=True)]
        self.optimizer.state.clear()
        if self.translation is not None:
            self.translation.start.clear()  # a later init (a load without optimizer state) starts afresh

    def adopt(self, opt_state: Any) -> None:
        """Hands a loaded train state's hyperparameters to the torch optimizer's param groups (optax: nothing)."""
        if self.translation is not None:
            self.translation.adopt(np.asarray(opt_state.hyper.addressable_data(0)))

    def indices(self) -> tuple[dict[str, int], list[list[int]]]:
        """torch's numbering in ``optimizer.state_dict()``: each parameter name's index, each group's indices.

        Examples:
            >>> given = GivenOptimizer(optax.sgd(0.1), names=(("w", "b"), ("n",)))
            >>> given.indices()
            ({'w': 0, 'b': 1, 'n': 2}, [[0, 1], [2]])
        """
        index: dict[str, int] = {}
        groups, begin = [], 0
        for names in self.names:
            for i, name in enumerate(names, begin):
                index.setdefault(name, i)  # torch numbers a parameter listed twice by its first place
            groups.append([index[n] for n in names])
            begin += len(names)
        return index, groups


def given_optimizer(
    optimizer: optax.GradientTransformation | torch.optim.Optimizer,
    model: torch.nn.Module,
    plan: ShardingPlan,
    layout: StateLayout,
) -> GivenOptimizer:
    """``optimizer`` (checked with the Trainer's arguments) as a step applies it; read before ``model`` moves.

    Raises:
        ArgumentError: a torch optimizer puts the layers of one scanned stack in different param groups.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return GivenOptimizer(optimizer)
    translation = translate(optimizer, model, plan, layout)
    ids = {id(p): n for n, p in model.named_parameters()}
    names = tuple(tuple(ids[id(p)] for p in g["params"]) for g in optimizer.param_groups)
    keys = {n: layout.position(plan.canonical(n)) for n in ids.values()}
    return GivenOptimizer(translation.transform(), optimizer, translation, names, keys)
