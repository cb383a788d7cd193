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

    Examples:
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
    """The tensors torch's ``state_dict()`` lists before any hook runs: params and persistent buffers, in its order.

    Read from the modules, not by calling ``state_dict()``: its hooks would run on whatever tensors
    the module holds (torchax tensors outside their environment). See `custom_state_dict`.

    Examples:
        >>> model = torch.nn.BatchNorm1d(2)
        >>> model.register_buffer("cache", torch.zeros(2), persistent=False)
        >>> state_dict_names(model) == list(model.state_dict())
        True
    """
    names = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        head = prefix + "." if prefix else ""
        names += [head + n for n, t in module._parameters.items() if t is not None]
        skip = module._non_persistent_buffers_set
        names += [head + n for n, t in module._buffers.items() if t is not None and n not in skip]
    return names


def custom_state_dict(model: torch.nn.Module) -> bool:
    """Whether torch's ``state_dict()`` of ``model`` runs code of its own: hooks, or an overridden save.

    Such code may rename, split or compute tensors (a fused projection exported as q/k/v), so an
    export must run it, on CPU tensors; otherwise the tensors and `state_dict_names` are the whole story.
    """
    base = torch.nn.Module
    for module in model.modules():
        kind = type(module)
        if module._state_dict_hooks or module._state_dict_pre_hooks:
            return True
        if kind.state_dict is not base.state_dict or kind._save_to_state_dict is not base._save_to_state_dict:
            return True
        if kind.get_extra_state is not base.get_extra_state:
            return True
    return False
