"""A Trainer's ``optimizer`` argument as its step applies it: an optax transformation as given, or a torch optimizer
translated (`transform.translate`), whose param groups are read before every step."""

from __future__ import annotations

import dataclasses

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
    return GivenOptimizer(translation.transform(), optimizer, translation, names)
