"""A Trainer's torch optimizer state in torch's layout: ``optimizer.state_dict()``, gathered from the shards."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import numpy as np
import torch

from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.tensors import to_torch
from torchshard._interop.export import host_array
from torchshard._train.optim.transform import Translation
from torchshard._trainer.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Held:
    """One torch parameter's optimizer state as the train state holds it."""

    index: int  # its number in ``optimizer.state_dict()``
    name: str  # its name in ``model.named_parameters()`` (DCP's fully qualified name)
    layer: int | None  # its index in a scanned stack, whose arrays hold every layer
    step: jax.Array  # the translation's step (SGD's too, which torch does not keep)
    fields: dict[str, jax.Array]  # torch's fields: torch's names, the parameter's dtype


def problems(trainer: Any, *, doing: str) -> list[str]:
    """Why ``trainer``'s optimizer state has no torch layout (empty if it has)."""
    if not isinstance(trainer, Trainer):
        return [f"{doing} takes a Trainer built with a torch.optim optimizer, got {type(trainer).__name__}"]
    if trainer.optimizer is None:
        return [
            f"{doing} needs a Trainer built with a torch.optim optimizer; this one steps an optax "
            f"GradientTransformation, which has no torch state_dict: save its whole state with ts.save (ts.load "
            f"resumes it), and its parameters with ts.to_torch_state_dict"
        ]
    return []


def translation_of(trainer: Trainer) -> Translation:
    """The translation of a Trainer's torch optimizer (checked by `problems`)."""
    translation = trainer.given_optimizer.translation
    assert translation is not None
    return translation


def held(trainer: Trainer) -> list[Held]:
    """Every torch parameter that has state, in torch's order (a frozen one, or one in no group, has none)."""
    given, state = trainer.given_optimizer, trainer.state.opt_state.state
    found = []
    for name, index in given.indices()[0].items():
        key, layer = given.keys[name]
        if key in state:
            fields = {f: state[key][f] for f in _torch_order(trainer, key)}
            found.append(Held(index, name, layer, state[key]["step"], fields))
    return found


def _torch_order(trainer: Trainer, key: str) -> list[str]:
    """The fields torch keeps for the parameter(s) of a train-state key, in the order torch makes them."""
    translation = translation_of(trainer)
    group, lead = translation.where(key)
    assert group is not None  # the key has state
    shape = tuple(trainer.state.params[key].shape)
    fields = translation.rule.fields(translation.flags[group], shape[lead:], tuple(range(len(shape) - lead)))
    return [f for f in fields if f not in translation.rule.hidden]


def param_groups(optimizer: torch.optim.Optimizer, params: list[list[Any]]) -> list[dict[str, Any]]:
    """Each group's values now (copies: a scheduler's ``initial_lr`` too) and its ``params`` as given."""
    groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]
    return [{**g, "params": p} for g, p in zip(groups, params, strict=True)]


def _layer(values: np.ndarray, layer: int | None) -> np.ndarray:
    return values if layer is None else values[layer]


def optimizer_state_dict(trainer: Trainer) -> dict[str, Any]:
    """A Trainer's torch optimizer state as ``optimizer.state_dict()`` lays it out, in plain CPU torch tensors.

    ``{"state": {index: {field: tensor}}, "param_groups": [{..., "params": [index, ...]}]}``, the
    parameters numbered as torch numbers them, each field gathered from its shards (a scanned or
    pipelined stack's, per layer) in the parameter's dtype, ``step`` as torch's float32 scalar. A
    parameter's state appears once it has been stepped, as in torch (Adagrad's from the start). The
    param groups are ``trainer.optimizer``'s now: a scheduler's ``lr`` and its ``initial_lr``
    included. ``torch.optim.X(model.parameters(), ...).load_state_dict(sd)`` takes it in a process
    without JAX and continues the run. With several processes every process must call it (the
    state is gathered with collectives).

    Args:
        trainer: a `Trainer` built with a ``torch.optim`` optimizer.

    Returns:
        The state dict, as ``trainer.optimizer.state_dict()`` would be for an eager run.

    Raises:
        ArgumentError: ``trainer`` is not a Trainer, or steps an optax optimizer (which has no torch state:
            `save` keeps it, `to_torch_state_dict` exports the parameters).

    Examples:
        >>> model = torch.nn.Linear(16, 4)
        >>> trainer = ts.Trainer(model, lambda m, x: m(x).square().mean(), torch.optim.AdamW(model.parameters()),
        ...                      ts.plan(model, ts.make_mesh({"data": 8})))
        >>> _ = trainer.step(torch.randn(8, 16))
        >>> sd = optimizer_state_dict(trainer)
        >>> sorted(sd["state"][0]), sd["state"][0]["step"], sd["param_groups"][0]["params"]
        (['exp_avg', 'exp_avg_sq', 'step'], tensor(1.), [0, 1])
        >>> torch.optim.AdamW(torch.nn.Linear(16, 4).parameters()).load_state_dict(sd)
    """
    raise_for_arguments(problems(trainer, doing="optimizer_state_dict()"), header="invalid optimizer_state_dict()")
    fresh_too = bool(translation_of(trainer).rule.fills)  # Adagrad's state exists from its constructor on
    gathered: dict[int, np.ndarray] = {}

    def host(array: jax.Array) -> np.ndarray:  # a stack's arrays gathered once for all its layers
        if id(array) not in gathered:
            gathered[id(array)] = host_array(array)
        return gathered[id(array)]

    state = {}
    with trainer.lock:
        for h in held(trainer):
            if fresh_too or float(_layer(host(h.step), h.layer)) > 0:
                values = {f: _layer(host(v), h.layer) for f, v in h.fields.items()}
                state[h.index] = {f: to_torch(v, getattr(torch, v.dtype.name)) for f, v in values.items()}
        groups = param_groups(trainer.optimizer, trainer.given_optimizer.indices()[1])  # type: ignore[arg-type]
    return {"state": dict(sorted(state.items())), "param_groups": groups}
