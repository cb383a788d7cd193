"""DCP's own reader, writer and planners, driven for one process's slices (the JAX processes agree among themselves).

A load: each process asks DCP for one box per tensor (the smallest box holding every slice its
devices need), through ``dcp.load(no_dist=True)`` with a planner that requests that box; DCP's
``FileSystemReader`` reads the stored chunks the box overlaps. A save: each process writes the
distinct shards it owns through ``FileSystemWriter`` and ``DefaultSavePlanner``'s global planning;
the plans and write results are exchanged through JAX's coordination service (no torch process
group is needed), and process 0 writes ``.metadata``.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import io
import itertools
import os
import pathlib
import pickle
import shutil
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from torchshard._base.errors import CheckpointError
from torchshard._interop.safetensors_files import DTYPES
from torchshard._multihost.agree import gathered

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, sizes
_CODES = {dtype: code for code, dtype in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor of a DCP checkpoint as `load_safetensors`'s checks see it."""

    shape: tuple[int, ...]
    dtype: str  # a safetensors dtype code where there is one, else torch's name
    torch_dtype: torch.dtype
    file: pathlib.Path  # named in messages: the checkpoint's metadata file


def read_metadata(root: pathlib.Path) -> Metadata:
    """The checkpoint's ``.metadata``, or a `CheckpointError` saying why ``root`` is not a DCP checkpoint."""
    if root.is_file():
        inside = " of a DCP checkpoint" if (root.parent / ".metadata").is_file() else ""
        raise CheckpointError(
            f"{root} is a file{inside}; pass the folder dcp.save wrote (checkpoint_id): {root.parent}"
        )
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory; pass the folder dcp.save wrote (checkpoint_id)")
    try:
        return dcp.FileSystemReader(str(root)).read_metadata()
    except FileNotFoundError as e:
        raise CheckpointError(f"{root} is not a torch.distributed.checkpoint folder: it has no .metadata ({e})") from e
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{root}/.metadata cannot be read as DCP metadata: {type(e).__name__}: {e}") from e


def stored_tensors(root: pathlib.Path, metadata: Metadata) -> dict[str, Stored]:
    """Every tensor entry (name → shape and dtype); byte entries (pickled objects) are left out."""
    found = {}
    for name, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            found[name] = Stored(tuple(md.size), _CODES.get(dtype, str(dtype)), dtype, root / ".metadata")
        # BytesStorageMetadata: param_groups, schedulers, data loaders: reported by the caller
    return found


def stored_objects(metadata: Metadata) -> list[str]:
    """Every non-tensor entry (``param_groups``' values, pickled by ``torch.save``)."""
    return [n for n, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]


def read_objects(root: pathlib.Path, metadata: Metadata, names: Sequence[str]) -> dict[str, Any]:
    """The non-tensor entries ``names``, unpickled as ``dcp.load`` unpickles them (``torch.load``, not weights-only:
    read only checkpoints you trust, as for ``dcp.load``)."""
    found: dict[str, Any] = dict.fromkeys(names)
    if not names:
        return found
    with warnings.catch_warnings():  # DCP warns on every load without a process group, no_dist or not
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(found, storage_reader=_CachedReader(root, metadata), planner=DefaultLoadPlanner(), no_dist=True)
        except CheckpointException as e:
            raise CheckpointError(damage(root, metadata, names[0], e)) from e
    return found


def damage(root: pathlib.Path, metadata: Metadata, name: str, error: CheckpointException) -> str:
    """Why DCP could not read tensor ``name``: each data file holding it named as missing, cut short or corrupted."""
    ends: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn == name:
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    failure = next(iter(error.failures.values()), None)
    cause = failure[0] if isinstance(failure, tuple) else failure
    reason = (str(cause).strip().splitlines() or [""])[0][:160]
    found = []
    for relative, end in sorted(ends.items()):
        path = root / relative
        if not path.exists():
            found.append(f"{path} is missing")
        elif (size := path.stat().st_size) < end:
            found.append(f"{path} is cut short ({size} bytes; the metadata places {name} up to byte {end})")
        else:
            found.append(f"{path} is corrupted ({type(cause).__name__}: {reason})")
    where = "; ".join(found) or f"{type(cause).__name__}: {reason}"
    return (
        f"DCP checkpoint {root} is damaged: {where}, and it holds {name}; nothing was loaded. Load another "
        f"checkpoint, or copy this one again whole"
    )


class _BoxPlanner(DefaultLoadPlanner):
    """Requests one box of each named tensor, read into the given buffers (DCP reshards stored chunks into them)."""

    def __init__(self, boxes: Mapping[str, tuple[Box, torch.Tensor]]) -> None:
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for name, ((offsets, _), buffer) in self.boxes.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=buffer.shape)
            md = self.metadata.state_dict_metadata[name]  # type: ignore[union-attr]
            items += create_read_items_for_chunk_list(name, md, [chunk])  # type: ignore[arg-type]
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        buffer = self.boxes[read_item.dest_index.fqn][1]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            buffer = buffer.narrow(dim, start, length)
        return buffer

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # DCP copied into the view resolve_tensor gave


class _CachedReader(dcp.FileSystemReader):
    """DCP's reader with its metadata read once (one ``dcp.load`` per tensor would read it every time)."""

    def __init__(self, root: pathlib.Path, metadata: Metadata) -> None:
        super().__init__(str(root))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


def box_of(indices: Sequence[tuple[slice, ...]], shape: tuple[int, ...]) -> Box:
    """The smallest box holding every index (each a tuple of slices with step 1)."""
    bounds = [[s.indices(d)[:2] for s, d in zip(index, shape, strict=False)] for index in indices]
    bounds = [b + [(0, d) for d in shape[len(b) :]] for b in bounds]
    starts = tuple(min(b[i][0] for b in bounds) for i in range(len(shape)))
    stops = tuple(max(b[i][1] for b in bounds) for i in range(len(shape)))
    return starts, tuple(e - s for s, e in zip(starts, stops, strict=True))


def _inside(inner: Box, outer: Box) -> bool:
    return all(o <= i and i + n <= o + m for i, n, o, m in zip(*inner, *outer, strict=True))


def _overlapping_bytes(md: Any, box: Box) -> int:
    """The bytes of the stored chunks ``box`` overlaps: what DCP's reader reads for it (whole chunks)."""
    total = 0
    for chunk in md.chunks:
        if all(o < s + n and s < o + m for o, m, s, n in zip(*box, chunk.offsets, chunk.sizes, strict=True)):
            total += int(torch.Size(chunk.sizes).numel()) * md.properties.dtype.itemsize
    return total


def _joined(a: Box, b: Box) -> Box | None:
    """``a`` and ``b`` as one box when they are adjacent along one dim and equal along the others."""
    differ = [d for d in range(len(a[0])) if (a[0][d], a[1][d]) != (b[0][d], b[1][d])]
    if len(differ) != 1:
        return None
    d = differ[0]
    first, second = (a, b) if a[0][d] < b[0][d] else (b, a)
    if first[0][d] + first[1][d] != second[0][d]:
        return None
    sizes = tuple(first[1][i] + (second[1][i] if i == d else 0) for i in range(len(a[0])))
    return first[0], sizes


def _first_joinable(boxes: Sequence[Box]) -> tuple[int, int, Box] | None:
    for i, j in itertools.combinations(range(len(boxes)), 2):
        if (box := _joined(boxes[i], boxes[j])) is not None:
            return i, j, box
    return None


def merged_boxes(indices: Sequence[tuple[slice, ...]], shape: tuple[int, ...]) -> list[Box]:
    """The distinct slices joined into as few boxes as adjacency allows (a process's devices' slices).

    Examples:
        >>> merged_boxes([(slice(0, 2),), (slice(2, 4),), (slice(6, 8),)], (8,))
        [((6,), (2,)), ((0,), (4,))]
    """
    boxes = list(dict.fromkeys(box_of([index], shape) for index in indices))
    while (pair := _first_joinable(boxes)) is not None:
        i, j, box = pair
        boxes = [b for k, b in enumerate(boxes) if k not in (i, j)] + [box]
    return boxes


class BoxReader:
    """Reads this process's boxes of one tensor at a time through ``dcp.load``; serves slices of them.

    `plan` says which boxes of a stored tensor this process needs: its devices' slices joined
    where adjacent, or their bounding box when separate boxes would make DCP read the same stored
    chunk twice (its reader reads a whole chunk per request). Implements what
    `load_safetensors`'s builder asks of a reader: ``tensors``, ``read``, ``release``.
    """

    def __init__(self, root: pathlib.Path, metadata: Metadata, tensors: Mapping[str, Stored]) -> None:
        self.root = root
        self.reader = _CachedReader(root, metadata)
        self.tensors = dict(tensors)
        self.boxes: dict[str, list[Box]] = {}
        self.requested = 0
        self._held: dict[str, list[tuple[Box, torch.Tensor]]] = {}

    def plan(self, name: str, indices: Sequence[tuple[slice, ...]]) -> None:
        """Records the boxes of ``name`` to read for these slices (index tuples of the stored tensor)."""
        shape, md = self.tensors[name].shape, self.reader.read_metadata().state_dict_metadata[name]
        boxes, whole = merged_boxes(indices, shape), box_of(indices, shape)
        separate = sum(_overlapping_bytes(md, b) for b in boxes)
        self.boxes[name] = boxes if separate <= _overlapping_bytes(md, whole) else [whole]

    def _box(self, name: str, wanted: Box) -> tuple[Box, torch.Tensor]:
        """The held box holding ``wanted``, read first if needed (a box of the plan, else ``wanted`` itself)."""
        held = next((h for h in self._held.get(name, []) if _inside(wanted, h[0])), None)
        if held is not None:
            return held
        box = next((b for b in self.boxes.get(name, []) if _inside(wanted, b)), wanted)
        buffer = torch.empty(box[1], dtype=self.tensors[name].torch_dtype)
        with warnings.catch_warnings():  # DCP warns on every load without a process group, no_dist or not
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            try:
                dcp.load({}, storage_reader=self.reader, planner=_BoxPlanner({name: (box, buffer)}), no_dist=True)
            except CheckpointException as e:  # "ranks:dict_keys([0])" and a traceback: said with the file instead
                raise CheckpointError(damage(self.root, self.reader.read_metadata(), name, e)) from e
        self.requested += _overlapping_bytes(self.reader.read_metadata().state_dict_metadata[name], box)
        self._held.setdefault(name, []).append((box, buffer))
        return box, buffer

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The slice ``index`` of tensor ``name`` (its box read first if not held), in the stored dtype."""
        shape = self.tensors[name].shape
        (offsets, _), part = self._box(name, box_of([index], shape))
        for dim, (s, size) in enumerate(zip(index, shape, strict=False)):
            start, stop, _ = s.indices(size)
            part = part.narrow(dim, start - offsets[dim], stop - start)
        return part

    def release(self) -> None:
        """Drops the boxes read so far (called after each destination array is built)."""
        self._held.clear()

    def total_bytes(self) -> int:
        return sum(int(torch.Size(t.shape).numel()) * t.torch_dtype.itemsize for t in self.tensors.values())


# --- writing ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One distinct shard this process writes: tensor name, the whole tensor's shape, where the shard sits."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor


class _ChunkPlanner(DefaultSavePlanner):
    """DefaultSavePlanner (its global plan and metadata) over chunks given directly instead of a state_dict."""

    def __init__(self, chunks: Sequence[Chunk], objects: Mapping[str, Any]) -> None:
        super().__init__(flatten_state_dict=False)
        self.chunks = {MetadataIndex(c.name, torch.Size(c.offsets)): c for c in chunks}
        self.objects = dict(objects)

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.storage_meta, self.is_coordinator = {}, storage_meta, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [_write_item(index, c) for index, c in self.chunks.items()]
        items += [WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO) for name in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:  # as DefaultSavePlanner writes a non-tensor: torch.save
            buffer = io.BytesIO()
            torch.save(self.objects[write_item.index.fqn], buffer)
            return buffer
        return self.chunks[write_item.index].data


def _write_item(index: MetadataIndex, chunk: Chunk) -> WriteItem:
    sizes = torch.Size(chunk.data.shape)
    return WriteItem(
        index=index,
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=sizes),
            properties=TensorProperties.create_from_tensor(chunk.data),
            size=torch.Size(chunk.shape),
        ),
    )


def _os_error(error: Exception, folder: pathlib.Path, needed: int) -> OSError:
    """A failed write as an ``OSError``: torch's zip writer reports a short write (a full disk) as a RuntimeError
    ("enforce fail at inline_container.cc ... unexpected pos"), which says nothing of the disk."""
    if isinstance(error, OSError):
        return error
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
    try:
        full = shutil.disk_usage(folder).free < needed
    except OSError:
        full = False
    code = errno.ENOSPC if full else errno.EIO
    return OSError(code, f"{os.strerror(code)} ({type(error).__name__}: {first})", str(folder))


def _pack(value: Any) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def _unpack(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))


def write_chunks(
    folder: pathlib.Path,
    chunks: Sequence[Chunk],
    *,
    rank: int,
    coordinator: bool,
    objects: Mapping[str, Any] | None = None,
) -> None:
    """Every process writes its chunks (and ``objects``, non-tensor entries) into ``folder`` with DCP's writer;
    process 0 writes the metadata.

    The steps of ``dcp.save``: local plans, one global plan (every process computes the same one
    from all local plans), the writes, then the metadata from every process's write results.
    """
    writer = dcp.FileSystemWriter(str(folder), overwrite=False)
    planner = _ChunkPlanner(chunks, objects or {})
    planner.set_up_planner({}, writer.storage_meta(), coordinator)
    writer.set_up_storage_writer(coordinator, rank=rank)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans = [_unpack(p) for p in gathered("dcp-save-plans", _pack(local))]
    global_plans, metadata = planner.create_global_plan(plans)
    central = writer.prepare_global_plan(global_plans)[rank]
    try:
        done = writer.write_data(planner.finish_plan(central), planner)
        done.wait()
        mine: Any = done.value()
    except (OSError, RuntimeError) as e:  # reported to every process, which would otherwise wait for this one's
        mine = _os_error(e, folder, sum(c.data.numel() * c.data.element_size() for c in chunks))
    results = [_unpack(r) for r in gathered("dcp-save-results", _pack(mine))]
    if failed := [r for r in results if isinstance(r, OSError)]:
        raise failed[0]
    if coordinator:
        writer.finish(metadata=metadata, results=results)
