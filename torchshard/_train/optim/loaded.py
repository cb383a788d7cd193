"""A torch optimizer's own state (``optimizer.state``, e.g. from ``load_state_dict``): checked against its parameters,
and read as the state a translation starts from (a scanned stack's layers stacked)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torchshard._train.optim.rules import Flags, Rule, Shape

Start = dict[str, dict[str, np.ndarray]]  # parameter name (or stacked key) → torch field → values
_UNREADABLE = (KeyError, IndexError, TypeError, ValueError, RuntimeError)


def torch_fields(rule: Rule, flags: Flags, shape: Shape) -> dict[str, Shape]:
    """The fields torch keeps for one parameter of ``shape`` (one layer's, in a scanned stack), with their shapes.

    Examples:
        >>> from torchshard._train.optim.rules import RULES
        >>> torch_fields(RULES["SGD"], {"momentum": True, "nesterov": False, "maximize": False}, (2, 3))
        {'momentum_buffer': (2, 3)}
    """
    fields = rule.fields(flags, shape, tuple(range(len(shape))))
    return {f: s for f, s in fields.items() if f not in rule.hidden}


def _field_problems(held: Mapping[str, Any], wanted: Mapping[str, Shape]) -> list[str]:
    problems = []
    for field, shape in wanted.items():
        value = held.get(field)
        if value is None:
            problems.append(f"missing {field}")
        elif isinstance(value, int | float) and field == "step" and shape == ():
            continue  # a step kept as a number, as torch did before 1.12
        elif not isinstance(value, torch.Tensor):
            problems.append(f"{field} is a {type(value).__name__}, not a tensor")
        elif tuple(value.shape) != shape:
            problems.append(f"{field} has shape {list(value.shape)}, not {list(shape)}")
    unexpected = [f for f, v in held.items() if f not in wanted and v is not None]
    return problems + ([f"unexpected {', '.join(unexpected)}"] if unexpected else [])


def state_problems(rule: Rule, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[str]:
    """Each parameter whose state in ``optimizer.state`` does not fit it (fields, shapes): what the step would
    otherwise start afresh. A parameter with no state starts afresh, as in torch.

    Examples:
        >>> from torchshard._train.optim.rules import RULES
        >>> model = torch.nn.Linear(2, 3)
        >>> optimizer = torch.optim.Adam(model.parameters(), amsgrad=True)
        >>> optimizer.state[model.bias] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2)}
        >>> state_problems(RULES["Adam"], optimizer, model)[0][:99]
        'optimizer state of bias [3] (param group 0): exp_avg has shape [2], not [3]; missing exp_avg_sq; mi'
    """
    names = {id(p): n for n, p in model.named_parameters()}
    kind = type(optimizer).__name__
    problems = []
    for i, group in enumerate(optimizer.param_groups):
        try:
            flags = rule.flags(group)
        except _UNREADABLE:
            continue  # a value that is no number: named by the hyperparameters' check
        for p in group["params"]:
            held = optimizer.state.get(p)
            if not held or id(p) not in names or not p.requires_grad:
                continue
            wrong = _field_problems(held, torch_fields(rule, flags, tuple(p.shape)))
            if wrong:
                problems.append(
                    f"optimizer state of {names[id(p)]} {list(p.shape)} (param group {i}): {'; '.join(wrong)}; load "
                    f"the state_dict a torch.optim.{kind} with these options saved for this model's parameters, in "
                    f"this order"
                )
    return problems


def start(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> Start:
    """What ``optimizer.state`` holds, by parameter name (SGD's momentum buffer says a step was taken)."""
    found = {}
    for p, fields in optimizer.state.items():
        if id(p) not in names:
            continue
        arrays = {f: np.asarray(torch.as_tensor(v).detach().cpu().float()) for f, v in fields.items() if v is not None}
        if "momentum_buffer" in arrays and "step" not in arrays:
            arrays["step"] = np.ones((), np.float32)
        found[names[id(p)]] = arrays
    return found


def stacked(
    start: Start, key: str, stacks: Mapping[str, list[str]], fills: Mapping[str, float]
) -> dict[str, np.ndarray]:
    """One train-state key's start: its parameter's, or a scanned stack's layers' stacked on dim 0 (a layer torch
    has not stepped yet: step 0 and fresh values, as ``fills`` or zeros)."""
    if key not in stacks:
        return start.get(key, {})
    held = [start.get(n, {}) for n in stacks[key]]
    like = {f: h[f] for h in held for f in h}
    return {f: np.stack([h.get(f, np.full_like(v, fills.get(f, 0.0))) for h in held]) for f, v in like.items()}
