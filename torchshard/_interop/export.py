"""Plain torch state_dicts out of and into sharded modules."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import torch
from jax.experimental import multihost_utils

from torchshard._base.errors import CheckpointError, raise_if_any
from torchshard._base.validate import instance_problems, mismatch_problems, raise_for_arguments
from torchshard._bridge.module_tensors import canonical_names, custom_state_dict, named_tensors, state_dict_names
from torchshard._bridge.tensors import bound, to_torch
from torchshard._ckpt.restore import Destination, plan_destination
from torchshard._ckpt.state import Target, export_arrays, model_of, target_problems, torch_dtypes
from torchshard._sharding.placement import assign, put, range_problems
from torchshard._sharding.plan import ShardingPlan
from torchshard._trainer.trainer import Trainer


def host_array(array: jax.Array) -> np.ndarray:
    """The whole array on this host (gathered from the other processes when not addressable here)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def torch_tensor(array: jax.Array, dtype: torch.dtype, *, name: str) -> torch.Tensor:
    """A placed array as a CPU torch tensor of ``dtype`` (a collective when it spans processes).

    Raises:
        CheckpointError: torch has no dtype for the array's (``name`` says which tensor).
    """
    host = host_array(array)
    try:
        return to_torch(host, dtype)
    except TypeError as e:
        raise CheckpointError(
            f"{name} {tuple(array.shape)} {array.dtype}: torch has no dtype for it ({e}); cast it to one torch has "
            f"(e.g. int8) before exporting"
        ) from e


def to_torch_state_dict(target: Target) -> dict[str, torch.Tensor]:
    """Gathers a sharded module's (or Trainer's) tensors into a plain CPU torch ``state_dict``.

    The result is what ``model.state_dict()`` of the unsharded torch module would be: the same
    keys in the same order, CPU tensors in the original dtypes, tied names sharing one tensor
    object. The tensors are gathered first and torch's own ``state_dict`` then runs on them, so
    state_dict hooks (a fused projection exported as separate weights) see CPU tensors and give
    the names and values torch would. It loads with ``load_state_dict`` in a process that never
    imports JAX. With several processes every process must call it (arrays are gathered with a
    collective).

    Args:
        target: a `Trainer` or a sharded module.

    Returns:
        ``{name: torch.Tensor}``.

    Raises:
        ArgumentError: ``target`` is not a Trainer or module.
        ShardingError: the module's tensors are not placed.
        CheckpointError: a tensor whose dtype torch has none for.

    Examples:
        >>> model = torch.nn.Linear(16, 4)
        >>> expected = {k: v.clone() for k, v in model.state_dict().items()}
        >>> ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8}), [("weight", (None, "data"))]))
        Linear(in_features=16, out_features=4, bias=True)
        >>> state = to_torch_state_dict(model)
        >>> torch.nn.Linear(16, 4).load_state_dict(state)
        <All keys matched successfully>
        >>> all(torch.equal(state[k], expected[k]) for k in expected)
        True
    """
    problems = target_problems(target)
    raise_for_arguments(problems, header="invalid to_torch_state_dict() arguments")
    return torch_state_dict(target, doing="to_torch_state_dict()")


def torch_state_dict(target: Target, *, doing: str) -> dict[str, torch.Tensor]:
    """Every tensor gathered to CPU, then torch's ``state_dict`` of the module run over them (hooks included)."""
    model = model_of(target)
    arrays = export_arrays(target, doing=doing)
    canonical = canonical_names(model)
    dtypes = torch_dtypes(target)
    # custom state_dict code may read any tensor; plain torch saves only params and persistent buffers
    names = list(canonical) if custom_state_dict(model) else state_dict_names(model)
    made: dict[str, torch.Tensor] = {}
    for name in names:
        canon = canonical[name]
        if canon not in made:
            made[canon] = torch_tensor(arrays[canon], dtypes[canon], name=canon)
    owner = target.lock if isinstance(target, Trainer) else contextlib.nullcontext()
    with owner, bound(model, {name: made[canonical[name]] for name in names}):
        return model.state_dict(keep_vars=True)  # keep_vars: the gathered tensors themselves, so ties stay one


def from_torch_state_dict(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], plan: ShardingPlan
) -> torch.nn.Module:
    """Places a plain torch ``state_dict`` onto ``plan`` and binds it into ``model``.

    The reverse of `to_torch_state_dict`: each process places only its own shards. Names and
    shapes are checked like torch's strict ``load_state_dict``, and values take the model's dtypes
    as ``load_state_dict`` copies them; non-persistent buffers (not in a ``state_dict``) keep the
    model's own values. ``model`` may be on ``meta`` (no memory).

    Args:
        model: the module (any device).
        state_dict: ``{name: tensor}``, e.g. from ``torch.load``.
        plan: the `ShardingPlan` of ``model``.

    Returns:
        ``model``, its tensors now sharded torchax tensors; ties stay tied.

    Raises:
        ArgumentError: bad ``model``, ``state_dict`` (or a value that is not a tensor) or ``plan``.
        ShardingError: every missing, unexpected, mis-shaped and meta tensor, or int64 values
            that 32 bits cannot hold (``jax_enable_x64`` off); ``model`` is left as it was.

    Examples:
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(16, 4)
        >>> state = torch.nn.Linear(16, 4).state_dict()
        >>> p = ts.plan(model, ts.make_mesh({"data": 8}), [("weight", (None, "data"))])
        >>> model = from_torch_state_dict(model, state, p)
        >>> model.weight.jax().sharding.spec, torch.equal(ts.to_torch_state_dict(model)["bias"], state["bias"])
        (P(None, 'data'), True)
    """
    _check_from_args(model, state_dict, plan)
    dest = plan_destination(model, plan)
    tensors = named_tensors(model)
    values = {c: _value_for(c, dest, state_dict, tensors) for c in dest.arrays}
    expected = {n: tuple(tensors[n].shape) for n in state_dict_names(model)}
    problems = mismatch_problems(
        expected, {n: tuple(v.shape) for n, v in state_dict.items()}, expected_in="model", found_in="state_dict"
    )
    problems += [p for c, v in values.items() for p in _value_problems(c, v, tensors[c])]
    raise_if_any(
        problems, header=f"state_dict does not fit {type(model).__name__}; load it into the model it came from"
    )
    # like torch's load_state_dict (which copies into the model's tensors), values take the model's dtypes
    cast = {c: torch.as_tensor(v).to(plan.entries[c].dtype) for c, v in values.items() if v is not None}
    raise_if_any([p for c, v in cast.items() for p in range_problems(c, v)], header="state_dict values JAX cannot hold")
    return assign(model, {c: put(v, dest.arrays[c].sharding, what=c) for c, v in cast.items()}, plan)


def _check_from_args(model: Any, state_dict: Any, plan: Any) -> None:
    problems = instance_problems("model", model, torch.nn.Module, "a torch.nn.Module (any device, meta included)")
    problems += instance_problems("state_dict", state_dict, Mapping, "a mapping name → tensor, e.g. torch.load(...)")
    problems += instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    if isinstance(state_dict, Mapping):
        problems += [
            f"state_dict[{n!r}] is a {type(v).__name__}; values must be torch tensors or numpy arrays"
            for n, v in state_dict.items()
            if not isinstance(v, torch.Tensor | np.ndarray)
        ]
    raise_for_arguments(problems, header="invalid from_torch_state_dict() arguments")


def _value_problems(canon: str, value: torch.Tensor | np.ndarray | None, own: torch.Tensor) -> list[str]:
    if value is None:
        return [f"{canon} {tuple(own.shape)}: a non-persistent buffer on meta (not in a state_dict, no values)"]
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return [f"{canon} {tuple(value.shape)}: the state_dict's tensor is on the meta device (no values)"]
    return []


def _value_for(
    canon: str, dest: Destination, state_dict: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    """The state_dict value of a tensor under any of its tied names, else the model's own (None on meta)."""
    for name, c in dest.names.items():
        if c == canon and name in state_dict:
            return state_dict[name]
    own = tensors[canon]
    return None if own.device.type == "meta" else own
