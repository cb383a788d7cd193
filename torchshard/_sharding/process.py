"""Which parts of a global array this process holds: process-local batch shapes and row slices."""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError
from torchshard._base.specs import SpecLike, as_spec, entry_axes
from torchshard._base.validate import describe_mesh


def process_shards(sharding: NamedSharding, ndim: int) -> list[tuple[int, int]]:
    """Per dim: (number of shards, how many distinct ones this process's devices hold)."""
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * ndim
    axes = [entry_axes(e) for e in spec[:ndim]]
    counts = tuple(int(np.prod([mesh.shape[a] for a in names], dtype=int)) for names in axes)
    held = sharding.addressable_devices_indices_map(counts).values()
    return [(n, len({_start(index, d) for index in held})) for d, n in enumerate(counts)]


def _start(index: tuple[slice, ...] | None, dim: int) -> int:
    """Where a device's block starts along ``dim`` (0 for a replicated dim)."""
    return 0 if index is None else index[dim].start or 0


def global_shape(
    local_shape: tuple[int, ...], sharding: NamedSharding, *, what: str = "array"
) -> tuple[tuple[int, ...], list[str]]:
    """The global shape of an array whose process-local part has ``local_shape``, and any problems.

    Args:
        local_shape: shape of this process's part (its rows of each sharded dim).
        sharding: the global array's sharding.
        what: how problems name the array.

    Returns:
        ``(global shape, problems)``; the problems say which dims do not split over this
        process's shards.

    Examples:
        >>> mesh = ts.make_mesh({"data": 8})
        >>> global_shape((16, 32), NamedSharding(mesh, P("data")))  # one process holds every row
        ((16, 32), [])
    """
    shape, problems = [], []
    for dim, (size, (shards, held)) in enumerate(
        zip(local_shape, process_shards(sharding, len(local_shape)), strict=True)
    ):
        if size % held:
            problems.append(
                f"{what} {tuple(local_shape)}: dim {dim} (size {size}) does not split over the {held} shards "
                f"this process holds on {describe_mesh(sharding.mesh)}; give each process a multiple of {held}"
            )
        shape.append(size // held * shards)
    return tuple(shape), problems


def local_batch_slice(batch_size: int, mesh: Mesh, batch_spec: SpecLike = ("data",)) -> slice:
    """The rows of a global batch that this process holds, for ``Trainer.step(batch, local=True)``.

    Args:
        batch_size: the global batch size.
        mesh: the training mesh.
        batch_spec: the Trainer's ``batch_spec``.

    Returns:
        A ``slice`` of the global batch's first dim (everything in a single-process run).

    Raises:
        ShardingError: the batch does not split over the mesh, or this process's rows are not
            contiguous (then give every process the global batch instead).

    Examples:
        >>> local_batch_slice(256, ts.make_mesh({"data": 8}))  # in a 1-process run: every row
        slice(0, 256, None)
        >>> # in a multi-process run: trainer.step((x[rows], y[rows]), local=True)
    """
    sharding = NamedSharding(mesh, PartitionSpec(*as_spec(batch_spec, what="batch_spec")[:1]))
    (shards, _held), *_ = process_shards(sharding, 1)
    if batch_size % shards:
        raise ShardingError(
            f"batch size {batch_size} does not split over the {shards} batch shards of {describe_mesh(mesh)}; "
            f"use a multiple of {shards}."
        )
    indices = sharding.addressable_devices_indices_map((batch_size,)).values()
    starts = sorted({_start(index, 0) for index in indices})
    rows = slice(starts[0], starts[-1] + batch_size // shards)
    if len(starts) * (batch_size // shards) != rows.stop - rows.start:
        raise ShardingError(
            f"this process's rows of the batch are not contiguous on {describe_mesh(mesh)} (shard starts "
            f"{starts}); pass the global batch to Trainer.step instead of a local slice."
        )
    return rows
