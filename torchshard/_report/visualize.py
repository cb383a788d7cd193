"""Text pictures of how tensors and plans are split over devices."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

import numpy as np
import torch
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from torchshard._base.errors import ShardingError
from torchshard._base.format import columns, fmt_bytes, fmt_shape
from torchshard._base.specs import entry_axes, spec_axes
from torchshard._base.validate import compiled, describe_mesh, instance_problems, raise_for_arguments, regex_problem
from torchshard._bridge.tensors import is_jax_tensor, unwrap
from torchshard._sharding.plan import PlanEntry, ShardingPlan

Blocks = dict[tuple[int, int], list[int]]  # (row block, column block) → ids of the devices holding it


def _blocks_from_indices(shape: Sequence[int], sharding: Sharding) -> Blocks:
    """Exact placement of a concrete sharding (any kind) from JAX's own device → index map."""
    blocks: Blocks = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        starts = [(s.start or 0) // max(1, (s.stop or n) - (s.start or 0)) for s, n in zip(index, shape, strict=True)]
        key = (0, starts[0]) if len(shape) == 1 else (starts[0], starts[1])
        blocks.setdefault(key, []).append(device.id)  # type: ignore[attr-defined]
    return blocks


def _blocks_from_spec(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh | AbstractMesh) -> Blocks:
    """Placement from the spec alone; an AbstractMesh has no device ids, so its devices are numbered in mesh order."""
    names, sizes = list(mesh.shape), list(mesh.shape.values())
    ids = [d.id for d in mesh.devices.flat] if isinstance(mesh, Mesh) else range(math.prod(sizes))
    entries = list(spec) + [None] * (len(shape) - len(spec))
    blocks: Blocks = {}
    for device, coords in zip(ids, np.ndindex(*sizes), strict=True):
        at = dict(zip(names, coords, strict=True))
        pos = [_block_index(entry_axes(e), at, mesh) for e in entries]
        key = (0, pos[0]) if len(shape) == 1 else (pos[0], pos[1])
        blocks.setdefault(key, []).append(device)
    return blocks


def _block_index(axes: tuple[str, ...], at: Mapping[str, int], mesh: Mesh | AbstractMesh) -> int:
    index = 0
    for axis in axes:  # the first axis of a dim is the major one
        index = index * mesh.shape[axis] + at[axis]
    return index


def _ids(ids: Sequence[int]) -> str:
    """``0-3,6``: sorted ids with runs of three or more collapsed."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def render_blocks(blocks: Blocks) -> str:
    """A box grid with one cell per block, labelled with the devices that hold it."""
    rows = 1 + max(r for r, _ in blocks)
    cols = 1 + max(c for _, c in blocks)
    labels = {key: _ids(ids) for key, ids in blocks.items()}
    width = max(7, *(len(label) + 2 for label in labels.values()))
    rule = lambda left, mid, right: left + mid.join("─" * width for _ in range(cols)) + right  # noqa: E731
    lines = [rule("┌", "┬", "┐")]
    for r in range(rows):
        lines.append("│" + "│".join(labels[r, c].center(width) for c in range(cols)) + "│")
        lines.append(rule("├", "┼", "┤") if r < rows - 1 else rule("└", "┴", "┘"))
    return "\n".join(lines)


def _drawable(shape: Sequence[int], what: str) -> None:
    if len(shape) not in (1, 2):
        fix = "t.reshape(1)" if not shape else f"t.reshape({shape[0]}, -1)"
        raise ShardingError(
            f"visualize(): {what} has shape {tuple(shape)} (rank {len(shape)}); only 1-D and 2-D tensors can be "
            f"drawn; reshape it first, e.g. {fix}, keeping the sharded dims whole"
        )


def _write(text: str, file: TextIO | None) -> None:
    (sys.stdout if file is None else file).write(text + "\n")


def visualize(tensor: torch.Tensor, *, file: TextIO | None = None) -> None:
    """Draws which devices hold which block of a placed 1-D or 2-D tensor (``jax.debug.visualize_array_sharding``).

    Args:
        tensor: a torchax tensor (from `shard`, `init_sharded`, a `Trainer` or `collectives.shard_map`).
        file: where to write the picture; defaults to ``sys.stdout``.

    Raises:
        ShardingError: the tensor is a plain torch tensor, or its rank is not 1 or 2.

    Examples:
        >>> model = torch.nn.Linear(8, 4)
        >>> _ = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), [("weight", ("model", None))]))
        >>> visualize(model.weight)
        4×8 float32, P('model', None) on Mesh(data=4, model=2): 2×8 per device
        ┌─────────┐
        │ 0,2,4,6 │
        ├─────────┤
        │ 1,3,5,7 │
        └─────────┘
    """
    if not is_jax_tensor(tensor):
        device = tensor.device.type if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ShardingError(
            f"visualize(): got a plain {device} tensor, which lives on no mesh; place it first "
            f"(torchshard.shard, init_sharded or collectives.shard_map)"
        )
    array = unwrap(tensor)
    _drawable(array.shape, f"the {str(tensor.dtype).removeprefix('torch.')} tensor")
    sharding = array.sharding
    where = f"{sharding.spec} on {describe_mesh(sharding.mesh)}" if isinstance(sharding, NamedSharding) else sharding
    head = (
        f"{fmt_shape(array.shape)} {str(tensor.dtype).removeprefix('torch.')}, {where}: "
        f"{fmt_shape(sharding.shard_shape(array.shape))} per device"
    )
    _write(head + "\n" + render_blocks(_blocks_from_indices(array.shape, sharding)), file)


def replicated_over(spec: PartitionSpec, mesh: Mesh | AbstractMesh) -> list[str]:
    """The mesh axes (of size > 1) that ``spec`` does not use: each block has one copy per device along them."""
    used = set(spec_axes(spec))
    return [a for a, n in mesh.shape.items() if a not in used and n > 1]


def _copies(spec: PartitionSpec, mesh: Mesh | AbstractMesh) -> str:
    free = replicated_over(spec, mesh)
    return f"{math.prod(mesh.shape[a] for a in free)} ({','.join(free)})" if free else "1"


def _pieces(entry: PlanEntry) -> str:
    return "×".join(str(n // s) if s else "1" for n, s in zip(entry.shape, entry.shard_shape, strict=True)) or "1"


def _plan_rows(plan: ShardingPlan, pattern: str | None) -> list[tuple[str, ...]]:
    aliases: dict[str, list[str]] = {}
    for name, entry in plan.entries.items():
        aliases.setdefault(entry.tied_to or name, []).append(name)
    rows: list[tuple[str, ...]] = []
    for entry in plan.unique_entries():
        names = aliases[entry.name]
        if pattern is not None and not any(compiled(pattern).search(n) for n in names):
            continue
        cells = (fmt_shape(entry.shape), _pieces(entry), fmt_shape(entry.shard_shape), _copies(entry.spec, plan.mesh))
        rows.append((" = ".join(names), *cells, fmt_bytes(entry.bytes_per_device)))
    return rows


def _summary(plan: ShardingPlan) -> str:
    replicated = [e for e in plan.unique_entries() if not any(entry_axes(entry) for entry in e.spec)]
    per_device = plan.bytes_per_device()
    return (
        f"{len(plan.unique_entries())} tensors, {fmt_bytes(per_device)} per device of {fmt_bytes(plan.total_bytes())}"
        f"; {len(replicated)} fully replicated ({fmt_bytes(sum(e.total_bytes for e in replicated))} on every device)"
    )


def visualize_plan(
    plan: ShardingPlan, *, names: str | None = None, grids: bool = False, file: TextIO | None = None
) -> None:
    """Writes one line per tensor of a plan: how it is cut, the shard each device holds, and its copies.

    Columns: ``pieces`` (blocks per dim, e.g. ``4×2``), ``shard`` (per-device shape), ``copies``
    (devices holding each block, with the mesh axes it is replicated over) and bytes per device.
    Tied tensors appear once, under all their names. Works on plans over an ``AbstractMesh``
    (devices are then numbered by mesh position).

    Args:
        plan: from `plan`.
        names: only tensors whose name matches this regex (``re.search``).
        grids: also draw the device grid of each 1-D/2-D tensor, as `visualize` does.
        file: where to write; defaults to ``sys.stdout``.

    Raises:
        ArgumentError: ``plan`` is not a plan, or ``names`` is not a usable regex.

    Examples:
        >>> layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 16))
        >>> p = ts.plan(layers, ts.make_mesh({"data": 8}), [(r"1\\.weight", ("data", None))])
        >>> visualize_plan(p, names=r"^1\\.")
        Mesh(data=8): 2 of 6 tensors shown
        tensor    shape  pieces  shard  copies    bytes/device
        1.weight  64×64  8×1     8×64   1         2.00 KiB
        1.bias    64     1       64     8 (data)  256 B
        6 tensors, 14.56 KiB per device of 28.56 KiB; 5 fully replicated (12.56 KiB on every device)
    """
    problems = instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    why = regex_problem(names) if names is not None else None
    problems += [f"names={names!r} {why}; pass a regex over tensor names, e.g. r'layers\\.0\\.'"] if why else []
    raise_for_arguments(problems, header="invalid visualize_plan() arguments")
    rows = _plan_rows(plan, names)
    head = f"{describe_mesh(plan.mesh)}: {len(rows)} of {len(plan.unique_entries())} tensors shown"
    lines = columns([("tensor", "shape", "pieces", "shard", "copies", "bytes/device"), *rows])
    if grids:
        lines = [lines[0], *(_with_grid(line, row[0], plan) for line, row in zip(lines[1:], rows, strict=True))]
    _write("\n".join([head, *lines, _summary(plan)]), file)


def _with_grid(line: str, names: str, plan: ShardingPlan) -> str:
    entry = plan.entries[names.split(" = ")[0]]
    if len(entry.shape) not in (1, 2):
        return f"{line}\n  (rank {len(entry.shape)}: no grid; see the pieces column)"
    grid = render_blocks(_blocks_from_spec(entry.shape, entry.spec, plan.mesh))
    return line + "\n" + "\n".join("  " + g for g in grid.splitlines())
