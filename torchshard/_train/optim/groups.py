"""A torch optimizer read against its model: which rule steps it, each group's parameters by name, its values now."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from torchshard._train.optim.loaded import state_problems
from torchshard._train.optim.rules import RULES, Rule

# the classes with a rule, by name; Adafactor where the installed torch has it
SUPPORTED: dict[str, type[torch.optim.Optimizer]] = {
    name: getattr(torch.optim, name) for name in RULES if hasattr(torch.optim, name)
}
# a flag's words in a message (the flags a rule derives from a value)
_FLAG_WORDS = {"momentum": "momentum != 0", "eps1_none": "eps[0] is None", "decoupled": "decoupled_weight_decay"}


def rule_for(optimizer: torch.optim.Optimizer) -> Rule | None:
    """The rule of ``optimizer``'s class, or None (a subclass may change ``step``, so it has none)."""
    name = type(optimizer).__name__
    return RULES[name] if SUPPORTED.get(name) is type(optimizer) else None


def _class_problems(optimizer: torch.optim.Optimizer) -> list[str]:
    kind = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        return [
            "optimizer is torch LBFGS, which re-evaluates the loss through a closure several times per step: "
            "a compiled step evaluates it once; use a first-order torch optimizer (AdamW, SGD...) instead"
        ]
    if type(optimizer) in SUPPORTED.values():
        return []
    base = next((c for c in type(optimizer).__mro__ if c in SUPPORTED.values()), None)
    if base is not None:
        return [
            f"optimizer is {kind}, a subclass of torch.optim.{base.__name__} whose step() may differ from it; "
            f"pass a torch.optim.{base.__name__}, or an optax GradientTransformation that does what {kind} does"
        ]
    return [
        f"optimizer is torch {kind}, which torchshard cannot translate; use torch.optim."
        f"{', '.join(SUPPORTED)}, or its optax equivalent (e.g. optax.{kind.lower()}(1e-3) where optax has it)"
    ]


def _membership_problems(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    where: dict[int, int] = {}
    foreign: list[tuple[int, ...]] = []
    problems = []
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                foreign.append(tuple(p.shape))
            elif id(p) in where and where[id(p)] != i:
                problems.append(
                    f"parameter {names[id(p)]} is in param groups {where[id(p)]} and {i}; put it in one group"
                )
            where.setdefault(id(p), i)
    if foreign:
        shapes = ", ".join(str(list(s)) for s in foreign[:6]) + (" ..." if len(foreign) > 6 else "")
        problems.insert(
            0,
            f"{len(foreign)} parameter(s) of the optimizer are not {type(model).__name__}'s (shapes {shapes}): build "
            f"the optimizer on this model's parameters (model.parameters(), or groups of them) before the Trainer "
            f"takes the model (a deep copy of the model has parameters of its own)",
        )
    return problems


def _complex_problems(model: torch.nn.Module) -> list[str]:
    return [
        f"parameter {n} is complex ({p.dtype}): torch steps it as pairs of reals, its translation does not; "
        f"keep it as two real parameters, or freeze it (requires_grad=False)"
        for n, p in model.named_parameters()
        if p.is_complex() and p.requires_grad
    ]


def torch_optimizer_problems(optimizer: torch.optim.Optimizer, model: Any) -> list[str]:
    """Why ``Trainer(model, ..., optimizer)`` cannot take this torch optimizer (empty if it can).

    Examples:
        >>> model = torch.nn.Linear(2, 2)
        >>> torch_optimizer_problems(torch.optim.AdamW(model.parameters()), model)
        []
        >>> torch_optimizer_problems(torch.optim.AdamW(torch.nn.Linear(2, 3).parameters()), model)[0][:63]
        "2 parameter(s) of the optimizer are not Linear's (shapes [3, 2]"
    """
    problems = _class_problems(optimizer)
    if not isinstance(model, torch.nn.Module):
        return problems
    problems += _membership_problems(optimizer, model)
    rule = rule_for(optimizer)
    if rule is not None:
        problems += hyperparameters(rule, optimizer.param_groups)[1] + state_problems(rule, optimizer, model)
    return problems + _complex_problems(model)


def group_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[list[str]]:
    """Each param group's trainable parameters by their name in ``model`` (one name per tied tensor)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]


def _number(group: Mapping[str, Any], name: str, key: str, index: int | None) -> float:
    value = group[key] if index is None else group[key][index]
    if value is None and name == "eps1":
        return 0.0  # Adafactor's eps=(None, ...): the parameter dtype's eps, read in the step
    return float(value)


def hyperparameters(rule: Rule, groups: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, list[str]]:
    """Each group's hyperparameters now (a float32 row per group, in ``rule.hyper``'s order); what is unreadable."""
    rows, problems = [], []
    for i, group in enumerate(groups):
        row = []
        for name, (key, index) in rule.hyper.items():
            try:
                row.append(_number(group, name, key, index))
            except (KeyError, IndexError, TypeError, ValueError, RuntimeError):
                shown = f"{key}={group.get(key)!r:.40}"
                problems.append(f"param group {i}: {shown} is not a number (or a 1-element tensor); set a number")
                row.append(0.0)
        rows.append(row)
    return np.asarray(rows, np.float32).reshape(len(rows), len(rule.hyper)), problems


def flag_problems(rule: Rule, groups: Sequence[Mapping[str, Any]], built: Sequence[Mapping[str, bool]]) -> list[str]:
    """The choices that changed since the Trainer was built (each changes the state the step keeps)."""
    if len(groups) != len(built):
        return [
            f"the optimizer has {len(groups)} param groups, {len(built)} when the Trainer was built: a group added "
            f"since is not trained; add every group before building the Trainer"
        ]
    problems = []
    for i, (group, was) in enumerate(zip(groups, built, strict=True)):
        now = rule.flags(group)
        for name in (n for n in was if now[n] != was[n]):
            words = _FLAG_WORDS.get(name, name)
            problems.append(
                f"param group {i}: {words} is {now[name]} now but was {was[name]} when the Trainer was built, which "
                f"changes the state its step keeps; set it before building the Trainer"
            )
    return problems
