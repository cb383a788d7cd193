"""Partition specs as users write them: concrete specs, rule specs (which may be callables) and their axes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jax.sharding import AbstractMesh, Mesh, PartitionSpec


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What a rule may look at to choose a spec: the tensor's name, shape, dtype, owner and the mesh."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    module_type: type | None
    mesh: Mesh | AbstractMesh


SpecLike = PartitionSpec | Sequence[Any] | str | None
"""A concrete spec: a ``PartitionSpec``, a tuple/list of axis names / ``None`` / tuples of names, one name, or None."""

SpecFn = Callable[[TensorInfo], PartitionSpec]
"""A rule spec computed per tensor (e.g. a tensor-parallel layout that depends on the module type)."""

RuleSpecLike = SpecLike | SpecFn

SPEC_HINT = "a PartitionSpec or a tuple of mesh-axis names / None / tuples of names; write e.g. ('data', None)"


def entry_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes one spec entry shards over.

    Examples:
        >>> entry_axes(None), entry_axes("data"), entry_axes(("data", "model"))
        ((), ('data',), ('data', 'model'))
    """
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec: PartitionSpec) -> list[str]:
    """Every mesh axis a spec names, in order, repeats included."""
    return [a for entry in spec for a in entry_axes(entry)]


def _entry_ok(entry: Any) -> bool:
    if entry is None or isinstance(entry, str):
        return True
    return isinstance(entry, tuple | list) and all(isinstance(a, str) for a in entry)


def parse_spec(spec: SpecLike) -> PartitionSpec | None:
    """A concrete spec as a ``PartitionSpec``, or None if it is not one (callables included)."""
    if spec is None:
        return PartitionSpec()
    if isinstance(spec, PartitionSpec):
        return spec
    if isinstance(spec, str):
        return PartitionSpec(spec)
    if isinstance(spec, tuple | list) and all(_entry_ok(e) for e in spec):
        return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in spec))
    return None


def as_spec(spec: SpecLike, *, what: str) -> PartitionSpec:
    """A concrete spec as a ``PartitionSpec``; anything else (a callable too) is a `TypeError` naming ``what``.

    Examples:
        >>> as_spec(("data", None), what="batch_spec")
        P('data', None)
        >>> as_spec(3, what="batch_spec")
        Traceback (most recent call last):
        ...
        TypeError: batch_spec=3 is not a PartitionSpec or a tuple of mesh-axis names / None / tuples of names; ...
    """
    made = parse_spec(spec)
    if made is None:
        raise TypeError(f"{what}={spec!r} is not {SPEC_HINT}")
    return made


def as_rule_spec(spec: RuleSpecLike) -> PartitionSpec | SpecFn | None:
    """A rule's spec: a concrete spec as a ``PartitionSpec``, a callable as it is, None if it is neither."""
    if callable(spec) and not isinstance(spec, PartitionSpec):
        return spec
    return parse_spec(spec)
