"""transformers' own checkpoint conversion (hub names → the model's), planned lazily: a converted tensor is a tree
of slices of the stored ones, so a device reads only the source tensors (and parts of them) its shard covers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

Read = Callable[[str, tuple[slice, ...]], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One stored tensor."""

    name: str
    shape: tuple[int, ...]

    def read(self, read: Read, index: tuple[slice, ...]) -> torch.Tensor:
        return read(self.name, index)


@dataclasses.dataclass(frozen=True)
class Stack:
    """``torch.stack(parts, dim)`` (transformers' ``MergeModulelist``): experts stored one by one."""

    dim: int
    parts: tuple[Node, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.parts[0].shape
        return (*inner[: self.dim], len(self.parts), *inner[self.dim :])

    def read(self, read: Read, index: tuple[slice, ...]) -> torch.Tensor:
        picked = range(*index[self.dim].indices(len(self.parts)))
        rest = index[: self.dim] + index[self.dim + 1 :]
        if not picked:  # an empty slice keeps the dtype and the other dims
            return self.parts[0].read(read, rest).unsqueeze(self.dim).narrow(self.dim, 0, 0)
        return torch.stack([self.parts[i].read(read, rest) for i in picked], dim=self.dim)


@dataclasses.dataclass(frozen=True)
class Cat:
    """``torch.cat(parts, dim)`` (transformers' ``Concatenate``): gate and up stored apart, fused in the model."""

    dim: int
    parts: tuple[Node, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.parts[0].shape
        return (*inner[: self.dim], sum(p.shape[self.dim] for p in self.parts), *inner[self.dim + 1 :])

    def read(self, read: Read, index: tuple[slice, ...]) -> torch.Tensor:
        start, stop, step = index[self.dim].indices(self.shape[self.dim])
        if step != 1:  # never from a sharding; read the span, then step through it
            whole = self.read(read, _at(index, self.dim, slice(None)))
            return whole[(slice(None),) * self.dim + (index[self.dim],)]
        pieces, offset = [], 0
        for part in self.parts:  # only the parts the slice overlaps are read
            size = part.shape[self.dim]
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                pieces.append(part.read(read, _at(index, self.dim, slice(low - offset, high - offset))))
            offset += size
        if not pieces:  # an empty slice keeps the dtype and the other dims
            return self.parts[0].read(read, _at(index, self.dim, slice(0, 0)))
        return torch.cat(pieces, dim=self.dim)


def _at(index: tuple[slice, ...], dim: int, span: slice) -> tuple[slice, ...]:
    """``index`` with ``span`` in place of its ``dim``-th slice."""
    return (*index[:dim], span, *index[dim + 1 :])


Node = Leaf | Stack | Cat
_UNKNOWN = (
    "transformers converts it with {op!r}, which load_safetensors does not implement; load it with "
    "from_pretrained, or save it in the model's own names (save_safetensors) and load that"
)


@dataclasses.dataclass(frozen=True)
class Conversion:
    """The model's names for a checkpoint's tensors: plain renames, and tensors built from several stored ones."""

    renamed: dict[str, str]  # model name → stored name
    built: dict[str, Node]  # model name → how it is built
    problems: list[str]


def transforms(model: torch.nn.Module) -> list[Any]:
    """transformers' weight transforms for ``model`` (as ``from_pretrained`` uses them); none for other modules.

    A wrapper (a peft model) gets those of the transformers model it wraps: they give that model's
    names, which ``rename=`` then maps to the wrapper's.
    """
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers absent, or too old to convert checkpoints
        return []
    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    return [] if inner is None else list(get_model_conversion_mapping(inner, add_legacy=True))


def convert(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]], expected: set[str]) -> Conversion:
    """How each stored tensor (``shapes``: name → shape) becomes ``model``'s, by transformers' conversion mapping.

    As ``from_pretrained``: every renaming applies, then at most one converter; a key the model
    holds as stored is kept. A converter's sources are taken in transformers' order (natural
    sort of the names, so expert 10 follows expert 9).
    """
    found = transforms(model)
    if not found:
        return Conversion({n: n for n in shapes}, {}, [])
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [t for t in found if isinstance(t, WeightRenaming)]
    converters = [t for t in found if isinstance(t, WeightConverter)]
    owner = {pattern: c for c in converters for pattern in c.source_patterns}
    renamed: dict[str, str] = {}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    problems = []
    for key in sorted(shapes, key=dot_natural_key):
        new, pattern = rename_source_key(key, renamings, converters)
        if new not in expected and key in expected:
            new, pattern = key, None
        if pattern is not None:
            groups.setdefault(new, (owner[pattern], {}))[1].setdefault(pattern, []).append(key)
        elif new in renamed:
            problems.append(f"{renamed[new]!r} and {key!r} both become {new!r} by transformers' conversion mapping")
        else:
            renamed[new] = key
    built: dict[str, Node] = {}
    for target, (converter, collected) in groups.items():
        node = _build(converter, collected, shapes)
        if isinstance(node, str):
            problems.append(f"{target} (from {_sources(collected)}): {node}")
        else:
            built[target] = node
    return Conversion(renamed, built, problems)


def _sources(collected: Mapping[str, Sequence[str]]) -> str:
    names = [n for keys in collected.values() for n in keys]
    return f"{names[0]} and {len(names) - 1} more" if len(names) > 1 else names[0]


def _build(converter: Any, collected: Mapping[str, Sequence[str]], shapes: Mapping[str, tuple[int, ...]]) -> Node | str:
    """The tree that ``converter``'s operations build from the stored tensors, or why it cannot be read lazily."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    nodes: dict[str, list[Node]] = {p: [Leaf(n, tuple(shapes[n])) for n in keys] for p, keys in collected.items()}
    targets = list(converter.target_patterns)
    for op in converter.operations:
        if type(op) is MergeModulelist:
            nodes = {targets[0] if len(nodes) == 1 else p: [Stack(op.dim, tuple(parts))] for p, parts in nodes.items()}
        elif type(op) is Concatenate and len(targets) == 1:
            ordered = [part for p in converter.source_patterns for part in nodes.get(p, [])]
            nodes = {targets[0]: [Cat(op.dim, tuple(ordered))]}
        else:
            return _UNKNOWN.format(op=op)
    if len(nodes) != 1 or len(parts := next(iter(nodes.values()))) != 1:
        return f"{converter!r} does not build one tensor from these; load it with from_pretrained"
    return _checked(parts[0])


def _checked(node: Node) -> Node | str:
    """``node``, or why its parts do not fit together (experts of different shapes, a missing one...)."""
    if isinstance(node, Leaf):
        return node
    for part in node.parts:
        if isinstance(why := _checked(part), str):
            return why
    shapes = [p.shape for p in node.parts]
    if isinstance(node, Cat):
        shapes = [s[: node.dim] + s[node.dim + 1 :] for s in shapes]
    if len(set(shapes)) > 1 or any(len(s) < node.dim for s in shapes):
        return f"its parts have shapes {[p.shape for p in node.parts]}, which do not {type(node).__name__.lower()}"
    return node


def leaves(node: Node) -> list[str]:
    """The stored tensors ``node`` is built from."""
    return [node.name] if isinstance(node, Leaf) else [n for p in node.parts for n in leaves(p)]
