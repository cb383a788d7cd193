"""Scanned and unscanned checkpoints are interchangeable: where each layer's tensor lives, and the moves between.

A train state keys each tensor by its torch name, except the layers of a scanned ModuleList,
whose tensors are stacked under ``prefix.*.suffix`` (a *stack*). A checkpoint records its
stacks, so a load can read whatever the checkpoint holds and build whatever the destination
holds: the same key as it is, a layer sliced out of a stack, or a stack assembled from layers
(optimizer state too: its leaves are keyed by the same names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from torchshard._sharding.placement import row_sharding, stack_placed

Stacks = Mapping[str, Sequence[str]]  # stacked key → the torch names of its layers, in order


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one torch tensor lives in a layout: a key, and its index when that key is a stack."""

    key: str
    index: int | None = None


def slots(stacks: Stacks) -> dict[str, Slot]:
    """torch name → `Slot` for every layer of every stack (other names live under their own key)."""
    return {name: Slot(key, i) for key, names in stacks.items() for i, name in enumerate(names)}


def slot_of(name: str, table: Mapping[str, Slot]) -> Slot:
    return table.get(name, Slot(name))


def layers_of(key: str, stacks: Stacks) -> list[str] | None:
    """The torch names a stacked key holds, or None for a plain key."""
    return list(stacks[key]) if key in stacks else None


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to build one destination array from arrays read from the checkpoint."""

    sources: tuple[Slot, ...]  # one per layer when the destination is a stack, else one
    stacked: bool


def recipe(key: str, dest_stacks: Stacks, source_slots: Mapping[str, Slot]) -> Recipe:
    """Where the values of the destination key ``key`` come from in the checkpoint."""
    layers = layers_of(key, dest_stacks)
    if layers is None:
        return Recipe((slot_of(key, source_slots),), stacked=False)
    return Recipe(tuple(slot_of(name, source_slots) for name in layers), stacked=True)


def read_sharding(
    slot: Slot, dest: jax.ShapeDtypeStruct, stacked_dest: bool, source_stacked: bool, row: int = 0
) -> Any:
    """The sharding to read a checkpoint array into, so building the destination moves little.

    A layer read for row ``row`` of a stacked destination is read onto the devices holding that
    row alone (a pipeline stage's), so no device receives another stage's layers.
    """
    sharding = dest.sharding
    if not isinstance(sharding, NamedSharding) or stacked_dest == source_stacked:
        return sharding
    spec = tuple(sharding.spec)
    if source_stacked:  # a stack read for per-layer destinations: the layers' spec behind a whole leading dim
        return NamedSharding(sharding.mesh, PartitionSpec(None, *spec))
    return row_sharding(sharding, dest.shape[0], row)  # layers read for a stacked destination


def stacked(parts: Sequence[jax.Array], like: Any) -> jax.Array:
    """``parts`` stacked into ``like``'s shape and sharding: on the devices that hold them where they lie so."""
    sharding = like.sharding
    shape = (len(parts), *parts[0].shape)
    whole = stack_placed(list(enumerate(parts)), shape, sharding) if isinstance(sharding, NamedSharding) else None
    return jax.device_put(jnp.stack(parts) if whole is None else whole, sharding)


def build(rec: Recipe, read: Mapping[str, jax.Array], dest: jax.ShapeDtypeStruct) -> jax.Array:
    """The destination array from what was read: taken as is, sliced out of a stack, or stacked."""
    parts = [read[s.key] if s.index is None else read[s.key][s.index] for s in rec.sources]
    value = stacked(parts, dest) if rec.stacked else parts[0]
    return jax.device_put(value.astype(dest.dtype), dest.sharding)


def rekey(path: tuple[Any, ...], keys: Mapping[str, str]) -> tuple[Any, ...]:
    """A tree path with each dict key found in ``keys`` replaced by its value."""
    return tuple(
        jax.tree_util.DictKey(keys[k.key]) if isinstance(k, jax.tree_util.DictKey) and k.key in keys else k
        for k in path
    )


def param_key(path: tuple[Any, ...], names: set[str]) -> str | None:
    """The parameter key an optimizer-state leaf belongs to (the dict key in its path that is one)."""
    found = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in names]
    return found[-1] if found else None
