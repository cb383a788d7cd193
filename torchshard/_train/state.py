"""The train state's layout: each key's shape, stored dtype and sharding, one source for Trainer and AbstractTrainer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import NamedSharding, PartitionSpec

from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import jax_dtype
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.scan import ScanGroup, StateLayout

Arrays = dict[str, jax.Array]
Structs = dict[str, jax.ShapeDtypeStruct]


class TrainState(NamedTuple):
    """Everything a step reads and writes: trainable params, carried buffers, optimizer state, step."""

    params: Arrays
    buffers: Arrays
    opt_state: Any
    step: jax.Array


def split_names(model: torch.nn.Module, plan: ShardingPlan) -> tuple[list[str], list[str], list[str]]:
    """Canonical names split into trainable params, buffers (carried and updated) and frozen params."""
    tensors = named_tensors(model)
    params, buffers, frozen = [], [], []
    for entry in plan.unique_entries():
        if entry.kind == "buffer":
            buffers.append(entry.name)
        elif tensors[entry.name].requires_grad:
            params.append(entry.name)
        else:
            frozen.append(entry.name)
    return params, buffers, frozen


def stack_problems(groups: Sequence[ScanGroup], plan: ShardingPlan) -> list[str]:
    """Scanned layers the plan shards differently: a stack holds them in one array with one spec."""
    problems = []
    for group in groups:
        for key, names in group.members():
            specs = {plan.spec(n) for n in names}
            if len(specs) > 1:
                problems.append(
                    f"{key}: the layers are sharded differently ({', '.join(f'{n} {plan.spec(n)}' for n in names)}); "
                    f"a scan stacks them, so give every layer the same spec"
                )
    return problems


def tensor_structs(
    plan: ShardingPlan, layout: StateLayout, names: Sequence[str], dtypes: Mapping[str, torch.dtype]
) -> Structs:
    """Train-state key → shape, stored dtype and sharding for the tensors ``names``.

    Layers of a scanned group are stacked on a new dim 0, split over the pipeline's stage axis
    when the group is pipelined; everything else is laid out as the plan says.
    """
    stacks = layout.stacks()
    structs = {}
    for key in layout.keys(names):
        layers = stacks.get(key, [key])
        entry = plan.entries[layers[0]]
        shape, spec = (entry.shape, entry.spec)
        if key in stacks:
            shape, spec = (len(layers), *entry.shape), PartitionSpec(layout.axis(key), *entry.spec)
        sharding = NamedSharding(plan.mesh, spec)
        structs[key] = jax.ShapeDtypeStruct(shape, jax_dtype(dtypes[layers[0]]), sharding=sharding)
    return structs


def state_shardings(opt_shapes: Any, params: Mapping[str, Any], replicated: NamedSharding) -> Any:
    """Shards each optimizer-state leaf like the param it belongs to (same dict key and shape)."""

    def leaf_sharding(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> Any:
        for key in reversed(path):
            name = getattr(key, "key", None)
            if isinstance(name, str) and name in params and tuple(leaf.shape) == tuple(params[name].shape):
                return params[name].sharding
        return replicated

    return jax.tree_util.tree_map_with_path(leaf_sharding, opt_shapes)


def train_state_structs(
    optimizer: optax.GradientTransformation, params: Structs, buffers: Structs, replicated: NamedSharding
) -> TrainState:
    """The whole train state as ShapeDtypeStructs: optimizer state sharded like its params, the step replicated."""
    shapes = jax.eval_shape(optimizer.init, params)
    shardings = state_shardings(shapes, params, replicated)
    opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return TrainState(params, buffers, opt_state, step)  # type: ignore[arg-type]  # stand-ins for arrays


def shardings_of(structs: Any) -> Any:
    """The sharding of every leaf of a tree of ShapeDtypeStructs (or arrays)."""
    return jax.tree.map(lambda s: s.sharding, structs)
