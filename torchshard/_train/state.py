"""The train state and its layout, in one home: which key holds each tensor (stacked per scanned group), each key's
shape, stored dtype and sharding, and the arrays a Trainer starts from; Trainer, AbstractTrainer and init_sharded
read it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import NamedSharding, PartitionSpec

from torchshard._bridge.layer_view import StackedArray, view_stacks
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import jax_dtype, unwrap
from torchshard._sharding.placement import put_stacked
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.scan import ScanGroup

Arrays = dict[str, jax.Array]
Structs = dict[str, jax.ShapeDtypeStruct]


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a train state stores a module's tensors: under their torch names, or stacked per scanned group."""

    groups: tuple[ScanGroup, ...] = ()

    def _positions(self) -> dict[str, tuple[str, int]]:
        return {name: (key, i) for g in self.groups for key, names in g.members() for i, name in enumerate(names)}

    def position(self, name: str) -> tuple[str, int | None]:
        """(train-state key, index in its stack or None) of a torch tensor name."""
        return self._positions().get(name, (name, None))

    def keys(self, names: Sequence[str]) -> list[str]:
        """The train-state keys that hold ``names``, in order, each once."""
        return list(dict.fromkeys(self.position(n)[0] for n in names))

    def stacks(self) -> dict[str, list[str]]:
        """Stacked key → the torch names of its layers, in stack order."""
        return {key: names for g in self.groups for key, names in g.members()}

    def axis(self, key: str) -> str | None:
        """The mesh axis a stacked key's layer dim is split over (a pipeline's stages), or None."""
        return next((g.axis for g in self.groups for k, _ in g.members() if k == key), None)


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


def physical(layout: StateLayout, structs: Structs, tensors: Mapping[str, Any]) -> Arrays:
    """Train-state key → array of ``structs``' keys: the module's ``tensors``, a scanned group's layers stacked."""
    stacks = layout.stacks()
    arrays = {}
    for key, struct in structs.items():
        if key in stacks:
            layers = [tensors[n] for n in stacks[key]]
            arrays[key] = put_stacked(layers, struct.sharding, dtype=struct.dtype, what=key)
        else:
            arrays[key] = unwrap(tensors[key])
    return arrays


def initial_state(
    optimizer: optax.GradientTransformation,
    params: Arrays,
    buffers: Arrays,
    params_structs: Structs,
    replicated: NamedSharding,
) -> TrainState:
    """The state a Trainer starts from: ``params`` and ``buffers`` as placed, the optimizer's state sharded like its
    params, step 0."""
    structs = train_state_structs(optimizer, params_structs, {}, replicated)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings_of(structs.opt_state))(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    return TrainState(params, buffers, opt_state, step)


def layer_views(
    model: torch.nn.Module, layout: StateLayout, arrays: Mapping[str, jax.Array]
) -> dict[str, StackedArray]:
    """Per-layer tensors of scanned blocks made views of the stacked state (no second copy): the stacks, by key."""
    return view_stacks(model, {k: (names, arrays[k]) for k, names in layout.stacks().items()})


def shardings_by_key(arrays: Mapping[str, jax.Array]) -> dict[str, NamedSharding]:
    """Each array's NamedSharding by train-state key (arrays placed otherwise left out)."""
    return {k: a.sharding for k, a in arrays.items() if isinstance(a.sharding, NamedSharding)}
