"""What a load reads from a checkpoint and builds for its destination, in either layout (scanned or not)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec

from torchshard._base.errors import raise_if_any
from torchshard._base.validate import mismatch_problems
from torchshard._bridge.module_tensors import canonical_names, named_tensors
from torchshard._bridge.tensors import jax_dtype, rebind
from torchshard._ckpt.layout import Recipe, Slot, build, param_key, read_sharding, rekey, slot_of, slots, stacked
from torchshard._ckpt.meta import flat
from torchshard._ckpt.state import Target, placed_arrays, trainer_tree
from torchshard._sharding.placement import assign
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.state import TrainState
from torchshard._trainer.trainer import Trainer

Meta = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Destination:
    """Where loaded tensors go.

    ``names`` maps every torch name to its canonical name (tied names share one); ``arrays``
    holds each destination key's shape, dtype and sharding — a canonical name, or for a scanned
    Trainer a stacked key, whose layers ``stacks`` lists.
    """

    names: dict[str, str]
    arrays: dict[str, jax.ShapeDtypeStruct]
    stacks: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical torch name → its shape (a stacked key's layers without the leading dim)."""
        shapes = {k: tuple(a.shape) for k, a in self.arrays.items() if k not in self.stacks}
        for key, names in self.stacks.items():
            shapes |= dict.fromkeys(names, tuple(self.arrays[key].shape[1:]))
        return shapes


def plan_destination(model: torch.nn.Module, plan: ShardingPlan) -> Destination:
    """The destination ``plan`` describes (``model`` may be on any device, meta included)."""
    have = canonical_names(model)
    problems = [f"{n}: in the plan but not in the model" for n in plan if n not in have]
    problems += [f"{n}: in the model but not in the plan" for n in have if n not in plan]
    raise_if_any(problems, header=f"plan does not fit {type(model).__name__}; re-run plan() on this model")
    arrays = {
        e.name: jax.ShapeDtypeStruct(e.shape, jax_dtype(e.dtype), sharding=e.sharding) for e in plan.unique_entries()
    }
    return Destination({n: plan.canonical(n) for n in plan}, arrays)


def trainer_destination(trainer: Trainer) -> Destination:
    """A Trainer's own layout: its train state's keys (scanned layers stacked) in their pinned shardings."""
    physical = trainer.physical_arrays()
    arrays = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in physical.items()}
    names = {n: trainer.plan.canonical(n) for n in trainer.plan}
    return Destination(names, arrays, {k: list(v) for k, v in trainer.layout.stacks().items()})


def placed_destination(model: torch.nn.Module) -> Destination:
    """A sharded module's own layout: its tensors' current shardings."""
    arrays = placed_arrays(model, doing="load() without plan=")
    abstract = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for n, a in arrays.items()}
    return Destination(canonical_names(model), abstract)


def destination(target: Target, plan: ShardingPlan | None) -> Destination:
    """Where a load puts the arrays: a Trainer's state, ``plan``'s shardings, or where the module's tensors sit."""
    if isinstance(target, Trainer):
        return trainer_destination(target)
    return plan_destination(target, plan) if plan is not None else placed_destination(target)


def bind_module(model: torch.nn.Module, arrays: dict[str, jax.Array], plan: ShardingPlan | None) -> None:
    """Binds loaded arrays to a module's tensors: placed per ``plan``, else onto the shardings they have."""
    if plan is not None:
        assign(model, arrays, plan)
    else:
        rebind(named_tensors(model), arrays)


def _stacks(meta: Meta) -> dict[str, list[str]]:
    return meta.get("stacks") or {}


def stored_layer_shape(meta: Meta, canon: str) -> list[int]:
    """The shape the checkpoint holds a canonical torch name in (a layer of a stack without its leading dim)."""
    slot = slot_of(canon, slots(_stacks(meta)))
    shape = meta["tensors"][slot.key]["shape"]
    return shape if slot.index is None else shape[1:]


def tensor_problems(meta: Meta, dest: Destination) -> list[str]:
    """Like torch's strict ``load_state_dict``, per torch name whatever the layouts: missing, unexpected, mis-shaped."""
    saved = {n: stored_layer_shape(meta, c) for n, c in meta["names"].items()}
    shapes = dest.layer_shapes()
    wanted = {n: shapes[c] for n, c in dest.names.items()}
    return mismatch_problems(wanted, saved, expected_in="model", found_in="checkpoint") + _tie_problems(meta, dest)


def _tie_problems(meta: Meta, dest: Destination) -> list[str]:
    """Names the model ties but the checkpoint stores with different values (one would be dropped)."""
    sums = {n: meta["tensors"][c]["checksum"] for n, c in meta["names"].items() if c in meta["tensors"]}
    return [
        f"tied {n} = {c}: one tensor in the model, different values in the checkpoint; untie them in the model"
        for n, c in dest.names.items()
        if n != c and n in sums and c in sums and sums[n] != sums[c]
    ]


def recipes(meta: Meta, dest: Destination) -> dict[str, Recipe]:
    """For each destination key, where its values are in the checkpoint."""
    table = slots(_stacks(meta))
    found = {}
    for key in dest.arrays:
        layers = dest.stacks.get(key)
        sources = [slot_of(meta["names"][n], table) for n in (layers or [key])]
        found[key] = Recipe(tuple(sources), stacked=layers is not None)
    return found


def _abstract(stored: Mapping[str, Any], sharding: Any) -> jax.ShapeDtypeStruct:
    # read in the stored dtype (so its checksum can be checked), onto a sharding near the destination's
    return jax.ShapeDtypeStruct(tuple(stored["shape"]), np.dtype(stored["dtype"]), sharding=sharding)


def model_item(meta: Meta, dest: Destination, plan: Mapping[str, Recipe]) -> dict[str, jax.ShapeDtypeStruct]:
    """The checkpoint arrays to read, each onto a sharding from which its destination is cheap to build."""
    item: dict[str, jax.ShapeDtypeStruct] = {}
    for key, recipe in plan.items():
        for row, slot in enumerate(recipe.sources):
            if slot.key not in item:
                sharding = read_sharding(slot, dest.arrays[key], recipe.stacked, slot.index is not None, row)
                item[slot.key] = _abstract(meta["tensors"][slot.key], sharding)
    return item


def destination_arrays(
    plan: Mapping[str, Recipe], read: Mapping[str, jax.Array], dest: Destination
) -> dict[str, jax.Array]:
    """Destination key → its array, in the destination's dtype and sharding."""
    arrays: dict[str, jax.Array] = {}
    for key, recipe in plan.items():
        array = build(recipe, read, dest.arrays[key])
        if any(array is a for a in arrays.values()):  # tied in the checkpoint, not in the model:
            array = jnp.copy(array)  # separate buffers, or donating both to a step would fail
        arrays[key] = array
    return arrays


@dataclasses.dataclass(frozen=True)
class TrainerRead:
    """How a Trainer's optimizer state, step and key are read: in the checkpoint's layout, then moved."""

    item: Any  # the tree to read, shaped like the saved one
    plan: Mapping[str, Recipe]

    def convert(self, restored: Any, trainer: Trainer) -> Any:
        """The restored tree in the destination's layout, dtypes and shardings."""
        source = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(restored)}
        names = set(trainer.state.params)

        def leaf(path: tuple[Any, ...], like: jax.Array) -> jax.Array:
            key = param_key(path, names)
            if key is None:
                return _moved(source[jax.tree_util.keystr(path)], like)
            recipe = self.plan[key]
            parts = [_layer(source[jax.tree_util.keystr(rekey(path, {key: s.key}))], s) for s in recipe.sources]
            return _moved(stacked(parts, like) if recipe.stacked else parts[0], like)

        return jax.tree_util.tree_map_with_path(leaf, trainer_tree(trainer))


def _layer(x: jax.Array, slot: Slot) -> jax.Array:
    return x if slot.index is None else x[slot.index]


def _moved(x: jax.Array, like: jax.Array) -> jax.Array:
    return jax.device_put(x.astype(like.dtype), like.sharding)


def trainer_read(meta: Meta, trainer: Trainer, plan: Mapping[str, Recipe], item: Mapping[str, Any]) -> TrainerRead:
    """The tree to read a Trainer's optimizer state into: the optimizer's own state for the checkpoint's params."""
    source_params = list(dict.fromkeys(s.key for k in trainer.state.params for s in plan[k].sources))
    abstract = {k: jax.ShapeDtypeStruct(item[k].shape, item[k].dtype) for k in source_params}
    opt = jax.eval_shape(trainer.transform.init, abstract)
    tree = {"opt_state": opt, "step": trainer.state.step, "rng": trainer.rng_key}
    replicated = NamedSharding(trainer.mesh, PartitionSpec())

    def read_as(path: tuple[Any, ...], x: Any) -> jax.ShapeDtypeStruct:
        key = param_key(path, set(source_params))
        saved = (meta["trainer"] or {}).get(jax.tree_util.keystr(path))
        shape, dtype = (saved["shape"], saved["dtype"]) if saved else (x.shape, x.dtype)
        sharding = item[key].sharding if key is not None and tuple(shape) == tuple(item[key].shape) else replicated
        return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)

    return TrainerRead(jax.tree_util.tree_map_with_path(read_as, tree), plan)


def trainer_problems(meta: Meta, read: TrainerRead | None) -> list[str]:
    """The checkpoint's optimizer/step leaves against the ones the Trainer's optimizer would have saved."""
    saved = meta["trainer"]
    if saved is None or read is None:
        return [
            "the checkpoint holds no optimizer state or step (it was saved from a module); "
            "load it into the module with load(path, model), then build the Trainer"
        ]
    wanted = {p: x.shape for p, x in flat(read.item).items()}
    found = {p: m["shape"] for p, m in saved.items()}
    problems = mismatch_problems(
        wanted, found, expected_in="trainer", found_in="checkpoint", what="optimizer/step leaf "
    )
    if problems:
        problems.append("the checkpoint's optimizer state differs: build the Trainer with the same optax optimizer")
    return problems


def load_trainer(trainer: Trainer, arrays: dict[str, jax.Array], tree: Any) -> None:
    """Hands a Trainer its loaded arrays (params, buffers and frozen params) and its optimizer state, step, key."""
    state = trainer.state
    frozen = {k: a for k, a in arrays.items() if k not in state.params and k not in state.buffers}
    trainer.load_state(
        TrainState(
            params={n: arrays[n] for n in state.params},
            buffers={n: arrays[n] for n in state.buffers},
            opt_state=tree["opt_state"],
            step=tree["step"],
        ),
        rng_key=tree["rng"],
        frozen=frozen,
    )
