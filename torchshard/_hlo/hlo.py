"""Parse a compiled program's HLO text: every collective, its bytes, device groups and mesh axes."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Sequence

import numpy as np
from jax.sharding import Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

Groups = tuple[tuple[int, ...], ...]

_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16}
_BITS |= {"s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s*(?P<op>(?:" + "|".join(KINDS) + r")(?:-start|-done)?)\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]\w*)\[(?P<dims>[\d,]*)\]")  # one HLO array type: f32[8,128]
_COMMENT = re.compile(r"/\*.*?\*/")
_LIST_GROUPS = re.compile(r"replica_groups=\{(?P<body>(?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\))?\s*\{(?P<over>[^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{(?P<body>(?:\{\d+,\d+\},?)*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
        kind: one of `KINDS`.
        name: the HLO instruction name.
        shapes: its result arrays as HLO writes them (several when XLA combined collectives).
        bytes: bytes of its result on one device.
        groups: the device groups it communicates within (for ``collective-permute`` the
            source → target pairs), as positions in the program's device order; None if unknown.
        axes: the mesh axes those groups span, when the mesh is known and they match; else None.
    """

    kind: str
    name: str
    shapes: tuple[str, ...]
    bytes: int
    groups: Groups | None
    axes: tuple[str, ...] | None = None

    @property
    def over(self) -> str:
        """The axes as text (``"data"``, ``"data,model"``), or the group size when unmatched."""
        if self.axes is not None:
            return ",".join(self.axes) or "(none)"
        if self.groups and self.kind != "collective-permute":
            return f"groups of {len(self.groups[0])}"
        return "?"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def array_bytes(text: str) -> int:
    """Bytes of every array type in HLO ``text`` on one device; a dtype not in the table counts 0.

    Examples:
        >>> array_bytes("(f32[2,4], bf16[8], pred[])")
        49
    """
    arrays = ((m.group("dtype"), _ints(m.group("dims"))) for m in _ARRAY.finditer(text))
    return sum(math.ceil(_BITS.get(dtype, 0) * math.prod(dims) / 8) for dtype, dims in arrays)


def array_dims(text: str) -> list[int]:
    """The dims of the first array type in HLO ``text`` (``"f32[2,4]"`` → ``[2, 4]``); none: ``[]``."""
    m = _ARRAY.search(text)
    return _ints(m.group("dims")) if m else []


def _shape_bytes(shape: str) -> tuple[tuple[str, ...], int]:
    return tuple(m.group(0) for m in _ARRAY.finditer(shape)), array_bytes(shape)


def _split_shape(rest: str) -> tuple[str, str]:
    """``"(f32[2], f32[]) all-reduce(...)"`` → (shape text, the remainder)."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :]
    return rest, ""


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _mesh_groups(match: re.Match[str]) -> Groups | None:
    axes = re.findall(r"'([^']+)'=(\d+)", match.group("axes"))
    over = re.findall(r"'([^']+)'(:\S+)?", match.group("over"))
    if any(sub for _, sub in over):
        return None  # sub-axis groups ('axis_0':(1)2) are not decoded
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = match.group("ids")
    if ids is None:
        flat = np.arange(math.prod(sizes))
    elif ids.startswith("["):
        dims, _, perm = ids[1:].partition("]")
        flat = _iota(_ints(dims), _ints(perm.strip("T()")) or None).reshape(-1)
    else:
        flat = np.array(_ints(ids))
    return _groups_along(flat.reshape(sizes), [names.index(a) for a, _ in over])


def _groups_along(ids: np.ndarray, dims: Sequence[int]) -> Groups:
    rest = [d for d in range(ids.ndim) if d not in dims]
    size = math.prod(ids.shape[d] for d in dims)
    rows = ids.transpose([*rest, *dims]).reshape(-1, size)
    return tuple(tuple(int(x) for x in row) for row in rows)


def _groups(attrs: str, partitions: int | None) -> Groups | None:
    if m := _PAIRS.search(attrs):
        return tuple(tuple(_ints(p)) for p in re.findall(r"\{([\d,]+)\}", m.group("body")))
    if m := _MESH_GROUPS.search(attrs):
        return _mesh_groups(m)
    if m := _IOTA_GROUPS.search(attrs):
        perm = _ints(m.group("perm") or "") or None
        return tuple(map(tuple, _iota(_ints(m.group("dims")), perm).reshape(_ints(m.group("shape"))).tolist()))
    if m := _LIST_GROUPS.search(attrs):
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", m.group("body")))
        if groups:
            return groups
        return (tuple(range(partitions)),) if partitions else None  # {} means one group of every device
    return None


def parse_hlo(text: str) -> tuple[Collective, ...]:
    """Every collective instruction of an HLO module's text (async start/done pairs counted once).

    Args:
        text: HLO text, e.g. ``jax.jit(f).lower(x).compile().as_text()``.

    Returns:
        The collectives in program order, without mesh axes (see `collectives`).

    Examples:
        >>> ops = parse_hlo("%ar = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={{0,1}}, to_apply=%add")
        >>> ops[0].kind, ops[0].bytes, ops[0].groups
        ('all-reduce', 32, ((0, 1),))
    """
    partitions = int(m.group(1)) if (m := _PARTITIONS.search(text)) else None
    starts: dict[str, str] = {}
    found = []
    for line in text.splitlines():
        inst = _INSTRUCTION.match(_COMMENT.sub("", line))
        if inst is None:
            continue
        shape, tail = _split_shape(inst.group("rest"))
        op = _OPCODE.match(tail)
        if op is None:
            continue
        kind, attrs = op.group("op"), tail[op.end() :]
        if kind.endswith("-start"):
            starts[inst.group("name")] = attrs
            continue
        if kind.endswith("-done"):
            kind = kind.removesuffix("-done")
            start = next((n for n in re.findall(r"%([\w.\-]+)", attrs) if n in starts), None)
            attrs = starts.get(start, attrs) if start is not None else attrs
        shapes, size = _shape_bytes(shape)
        found.append(Collective(kind, inst.group("name"), shapes, size, _groups(attrs, partitions)))
    return tuple(found)


def _axis_subsets(mesh: Mesh) -> Iterable[tuple[str, ...]]:
    names = tuple(mesh.shape)
    return (c for r in range(len(names) + 1) for c in itertools.combinations(names, r))


def axes_of(op: Collective, mesh: Mesh) -> tuple[str, ...] | None:
    """The mesh axes ``op``'s groups run along (positions = ``mesh.devices.flat``), or None."""
    if not op.groups:
        return None
    ids = np.arange(mesh.devices.size).reshape(tuple(mesh.shape.values()))
    if op.kind == "collective-permute":
        where = [np.argwhere(ids == i)[0] for pair in op.groups for i in pair]
        moved = {d for a, b in zip(where[::2], where[1::2], strict=True) for d in np.flatnonzero(a != b)}
        return tuple(name for d, name in enumerate(mesh.shape) if d in moved)
    want = {frozenset(g) for g in op.groups}
    names = list(mesh.shape)
    for subset in _axis_subsets(mesh):
        if {frozenset(g) for g in _groups_along(ids, [names.index(a) for a in subset])} == want:
            return subset
    return None
