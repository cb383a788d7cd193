"""The tensors a torch module holds: every parameter and buffer name, and which names share one tensor."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Literal

import torch

Kind = Literal["param", "buffer"]


@dataclasses.dataclass(frozen=True)
class ModuleTensor:
    """One name of a module's tensor: its owner's type and whether it is a parameter or a buffer."""

    name: str
    tensor: torch.Tensor
    module_type: type
    kind: Kind


def model_tensors(model: torch.nn.Module) -> list[ModuleTensor]:
    """Params and buffers (persistent or not) under every name, tied names included.

    Example:
        >>> lin = torch.nn.Linear(2, 3)
        >>> [(t.name, t.kind) for t in model_tensors(lin)]
        [('weight', 'param'), ('bias', 'param')]
    """
    found: dict[str, ModuleTensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        head = prefix + "." if prefix else ""
        for leaf, t in module._parameters.items():
            if t is not None:
                found.setdefault(head + leaf, ModuleTensor(head + leaf, t, type(module), "param"))
        for leaf, t in module._buffers.items():
            if t is not None:
                found.setdefault(head + leaf, ModuleTensor(head + leaf, t, type(module), "buffer"))
    return list(found.values())


def set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor, *, param: bool) -> None:
    """Binds ``value`` under ``name`` as a parameter or buffer, as it is (no ``Parameter`` wrapping).

    Writing ``_parameters`` directly (what ``register_parameter`` does after its checks) keeps a
    torchax tensor, or a view of a stacked array, the very object the module holds.
    """
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if param:
        module._parameters[leaf] = value  # type: ignore[assignment]
    else:
        module._buffers[leaf] = value


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name → tensor for every param and buffer name (tied aliases map to the same object)."""
    return {t.name: t.tensor for t in model_tensors(model)}


def tie_groups(tensors: Iterable[ModuleTensor]) -> dict[str, str]:
    """name → canonical name (the first name the tensor appears under)."""
    first: dict[int, str] = {}
    return {t.name: first.setdefault(id(t.tensor), t.name) for t in tensors}


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every param/buffer name (tied aliases included) → the name its tensor is stored under."""
    return tie_groups(model_tensors(model))


def state_dict_names(model: torch.nn.Module) -> list[str]:
    """The keys torch's ``state_dict()`` has (persistent buffers only, tied aliases included), in order."""
    return list(model.state_dict(keep_vars=True))
