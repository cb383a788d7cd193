"""What a checkpoint or export holds: a module's placed arrays and a trainer's optimizer state, step and key."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import torch

from torchshard._base.errors import raise_if_any
from torchshard._base.validate import instance_problems
from torchshard._bridge.module_tensors import canonical_names, model_tensors, named_tensors
from torchshard._bridge.tensors import is_jax_tensor, unwrap
from torchshard._trainer.trainer import Trainer

Target = Trainer | torch.nn.Module


def model_of(target: Target) -> torch.nn.Module:
    """The module of a Trainer, or the module itself."""
    return target.model if isinstance(target, Trainer) else target


def target_problems(target: Any) -> list[str]:
    """What is wrong with the ``target`` of a save or an export: neither a Trainer nor a module."""
    return instance_problems("target", target, (Trainer, torch.nn.Module), "a Trainer or a sharded module")


def placed_arrays(model: torch.nn.Module, *, doing: str) -> dict[str, jax.Array]:
    """Canonical name → the ``jax.Array`` behind each placed tensor (tied tensors once)."""
    tensors = named_tensors(model)
    canonical = list(dict.fromkeys(canonical_names(model).values()))
    unplaced = [n for n in canonical if not is_jax_tensor(tensors[n])]
    raise_if_any(
        [f"{n} {tuple(tensors[n].shape)}: a plain torch tensor on {tensors[n].device}" for n in unplaced],
        header=f"{doing}: {type(model).__name__} is not sharded; place it with torchshard.shard(model, plan) first",
    )
    return {n: unwrap(tensors[n]) for n in canonical}


def trainer_tree(trainer: Trainer) -> dict[str, Any]:
    """The non-module part of a trainer: optimizer state, step counter and RNG base key."""
    # a torch optimizer's hyperparameters as its param groups hold them now (a scheduler stepped since the last
    # step): what `load` hands back to the resumed optimizer's groups
    state = trainer.given_optimizer.refresh(trainer.state)
    return {"opt_state": state.opt_state, "step": state.step, "rng": trainer.rng_key}


def state_tree(target: Target, *, doing: str) -> dict[str, Any]:
    """``{"model": key → array}`` plus ``"trainer"`` for a Trainer: everything a checkpoint stores.

    A Trainer's arrays are keyed as its train state keys them (scanned layers stacked).
    """
    if not isinstance(target, Trainer):
        return {"model": placed_arrays(target, doing=doing)}
    return {"model": target.physical_arrays(), "trainer": trainer_tree(target)}


class _Lazy(Mapping[str, jax.Array]):
    """name → array of a module's tensors, each read when asked for (a scanned layer is sliced then)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: list[str]) -> None:
        self._tensors, self._names = tensors, names

    def __getitem__(self, name: str) -> jax.Array:
        if name not in self._names:
            raise KeyError(name)
        return unwrap(self._tensors[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def export_arrays(target: Target, *, doing: str) -> Mapping[str, jax.Array]:
    """Canonical torch name → array, per layer even for a scanned Trainer (layers are sliced one at a time)."""
    model = model_of(target)
    if not isinstance(target, Trainer):
        return placed_arrays(model, doing=doing)
    return _Lazy(named_tensors(model), list(dict.fromkeys(canonical_names(model).values())))


def torch_dtypes(target: Target) -> dict[str, torch.dtype]:
    """The torch dtype of each tensor (a Trainer remembers e.g. int64 buffers JAX holds as int32, and master dtypes)."""
    tensors = {t.name: t.tensor.dtype for t in model_tensors(model_of(target))}
    if isinstance(target, Trainer):
        tensors |= target.tensor_dtypes()
    return tensors
