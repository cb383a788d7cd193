"""Array data of checkpoints: each process writes its shards into one file (one fsync) and reads any slice back.

A step's ``state/`` holds, per process ``i`` of the save, ``process_<i>.bin`` (the bytes of that
process's replica-0 shards, back to back, row-major) and ``process_<i>.json`` (for each array,
by its tree path: global shape, dtype, and each shard's index and byte offset). Replica 0 of
every shard is on exactly one process, so each element is written once. A load reads, for each
of its devices' slices, the overlapping byte ranges of whichever files hold them (with one
``preadv`` where a slice is one run of a stored shard's bytes, else from the memory-mapped file),
so a checkpoint loads onto any mesh and plan. Checkpoints written through orbax before this
format (``state/_METADATA``) are read by orbax.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import mmap
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torchshard._base.errors import CheckpointError
from torchshard._ckpt.checksum import on_host, shard_sums
from torchshard._multihost.agree import flagged_processes

FORMAT = "torchshard-shards"
VERSION = 1
Bounds = tuple[tuple[int, int], ...]  # [start, stop) per dimension
_READERS = 3  # threads reading arrays: the device copies and checksums of one overlap the reads of others


def data_name(process: int) -> str:
    """The data file of one process.

    Examples:
        >>> data_name(3)
        'process_00003.bin'
    """
    return f"process_{process:05d}.bin"


def index_name(process: int) -> str:
    return f"process_{process:05d}.json"


def unwritable(tree: dict[str, Any]) -> list[str]:
    """Every array of ``tree`` whose dtype has no numpy equivalent (PRNG key arrays), named, with the fix."""
    problems = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            name = path[1].key if len(path) == 2 and path[0].key == "model" else jax.tree_util.keystr(path)
            problems.append(
                f"{name} {tuple(leaf.shape)} {dtype}: the checkpoint format (raw bytes of numpy dtypes) cannot hold "
                f"{dtype}; store jax.random.key_data(key) instead"
            )
    return problems


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> Bounds:
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))


def _local_shards(x: Any) -> Iterator[tuple[Bounds, np.ndarray]]:
    """This process's part of ``x`` to write: its replica-0 shards (a host value: the primary, whole)."""
    if not isinstance(x, jax.Array):
        if jax.process_index() == 0:
            value = np.asarray(x)
            yield tuple((0, n) for n in value.shape), value
        return
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            yield _bounds(tuple(shard.index), tuple(x.shape)), np.asarray(shard.data)


def _write_all(fd: int, data: np.ndarray) -> None:
    view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    while view:
        view = view[os.write(fd, view) :]


def _write_file(file: pathlib.Path, tree: Any) -> dict[str, Any]:
    """Writes this process's shards of ``tree`` to ``file``, fsynced; returns the index of what it wrote."""
    arrays: dict[str, Any] = {}
    offset = 0
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            shards = []
            for bounds, data in _local_shards(x):
                _write_all(fd, data)
                shards.append({"index": [list(b) for b in bounds], "offset": offset, "nbytes": data.nbytes})
                offset += data.nbytes
            arrays[jax.tree_util.keystr(path)] = {"shape": list(x.shape), "dtype": str(x.dtype), "shards": shards}
        os.fsync(fd)
    finally:
        os.close(fd)
    return arrays


def write_state(directory: pathlib.Path, tree: dict[str, Any], *, key: str = "torchshard") -> None:
    """Every process writes its shards of ``tree`` into its own file in ``directory``; returns once all have.

    The processes then meet at the coordination service (at ``key``, unique per save), not at a
    device collective: a background save must not run collectives beside the training step's.
    A process whose write failed raises its own error, the others a `CheckpointError` naming it.
    """
    process = jax.process_index()
    failure: Exception | None = None
    try:
        os.makedirs(directory, exist_ok=True)
        arrays = _write_file(directory / data_name(process), tree)
        index = {"format": FORMAT, "version": VERSION, "process": process, "arrays": arrays}
        with open(directory / index_name(process), "w") as f:
            json.dump(index, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:  # any failure, held until the others know: raising alone would leave them waiting
        failure = e
    failed = flagged_processes(f"{key}-written", failure is not None)
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(f"process(es) {failed} could not write their shards (their own errors say why)")


class _Damaged(Exception):
    """The shard files do not hold what the index says (reported as a `CheckpointError` naming the step)."""


Sums = tuple[int, int] | None  # this process's part of an array's checksum; None: the device sums it


@dataclasses.dataclass(frozen=True)
class _Request:
    """One array to read: its index entry, and each addressable device's slice of it."""

    key: str
    abstract: jax.ShapeDtypeStruct
    entry: dict[str, Any]
    slices: dict[Any, Bounds]  # device → bounds
    owned: frozenset[Bounds]  # the slices this process sums for the checksum: each element once over processes
    pieces: dict[Bounds, list[tuple[dict[str, Any], Bounds]]]  # per slice: the stored shards it overlaps, and where


class _Stored:
    """Every process's index of one saved step, and its data files, each opened once before anything is read."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.arrays: dict[str, dict[str, Any]] = {}
        self._maps: dict[str, np.ndarray] = {}
        self._fds: dict[str, int] = {}
        self._mmaps: dict[str, mmap.mmap] = {}
        for file in sorted(directory.glob("process_*.json")):
            index = json.loads(file.read_text())
            if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
                raise _Damaged(f"{file.name} is not a {FORMAT} version {VERSION} index")
            data = file.with_suffix(".bin").name
            for key, entry in index["arrays"].items():
                stored = self.arrays.setdefault(key, {"shape": entry["shape"], "dtype": entry["dtype"], "shards": []})
                stored["shards"] += [dict(s, file=data) for s in entry["shards"]]
        if not self.arrays:
            raise _Damaged("no shard index (process_*.json)")

    def request(self, key: str, abstract: jax.ShapeDtypeStruct) -> _Request:
        entry = self.arrays.get(key)
        if entry is None:
            raise _Damaged(f"{key}: not in the shard index")
        shape = tuple(abstract.shape)
        if tuple(entry["shape"]) != shape:
            raise _Damaged(f"{key}: stored as {tuple(entry['shape'])}, the metadata says {shape}")
        owners: dict[Bounds, Any] = {}  # the first device holding each slice sums it (any fixed choice would do)
        for device, index in abstract.sharding.devices_indices_map(shape).items():
            owners.setdefault(_bounds(tuple(index), shape), device)
        local = abstract.sharding.addressable_devices_indices_map(shape)
        slices = {d: _bounds(tuple(i), shape) for d, i in local.items()}
        mine = jax.process_index()
        owned = frozenset(b for b in set(slices.values()) if owners[b].process_index == mine)
        pieces = {b: list(_overlaps(entry, b)) for b in set(slices.values())}
        return _Request(key, abstract, entry, slices, owned, pieces)

    def open_files(self, requests: list[_Request]) -> None:
        """Opens (and maps, for slices that several stored shards make up) every file the requests touch."""
        for name in {shard["file"] for r in requests for pieces in r.pieces.values() for shard, _ in pieces}:
            path = self.directory / name
            if path.stat().st_size == 0:
                raise _Damaged(f"{name}: empty, the index lists shards in it")
            self._fds[name] = os.open(path, os.O_RDONLY)
            with open(path, "rb") as f:
                self._mmaps[name] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            self._maps[name] = np.frombuffer(self._mmaps[name], np.uint8)

    def close(self) -> None:
        """Closes the files and unmaps them (a traceback that keeps this object must not keep the mappings)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._maps.clear()
        for mapped in self._mmaps.values():
            with contextlib.suppress(BufferError):  # a view still held elsewhere: unmapped when it goes
                mapped.close()
        self._mmaps.clear()

    def _checked(self, shard: dict[str, Any], dtype: np.dtype) -> tuple[int, tuple[int, ...]]:
        """A stored shard's byte offset and shape, once its index entry is known to fit its file."""
        name = shard["file"]
        shape = tuple(b - a for a, b in shard["index"])
        offset, nbytes = int(shard["offset"]), int(shard["nbytes"])
        if nbytes != math.prod(shape) * dtype.itemsize or offset + nbytes > self._maps[name].size:
            raise _Damaged(f"{name}: a shard of {shape} {dtype} at byte {offset} does not fit the file")
        return offset, shape

    def piece(self, shard: dict[str, Any], dtype: np.dtype) -> np.ndarray:
        """One stored shard as an array over its mapped bytes."""
        offset, shape = self._checked(shard, dtype)
        return self._maps[shard["file"]][offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)

    def read(self, request: _Request) -> tuple[jax.Array, Sums]:
        """The array in ``request``'s sharding, each device's slice built from the shards it overlaps, and its sums."""
        abstract, dtype = request.abstract, jnp.dtype(request.entry["dtype"])
        shape = tuple(abstract.shape)
        summed = on_host(dtype)
        host: dict[Bounds, np.ndarray] = {}
        singles, sums = [], []
        for device, bounds in request.slices.items():
            if bounds not in host:
                stored = self._assemble(request.key, request.pieces[bounds], bounds, dtype)
                if summed and bounds in request.owned:
                    sums.append(shard_sums(stored, tuple(slice(a, b) for a, b in bounds), shape))
                host[bounds] = stored.astype(abstract.dtype, copy=False)
                host[bounds].flags.writeable = False  # an aligned read-only buffer: jax may take it without a copy
            singles.append(jax.device_put(host[bounds], device))
        total = (sum(s[0] for s in sums) % 2**32, sum(s[1] for s in sums) % 2**32) if summed else None
        return jax.make_array_from_single_device_arrays(shape, abstract.sharding, singles), total

    def _assemble(
        self, key: str, pieces: list[tuple[dict[str, Any], Bounds]], bounds: Bounds, dtype: np.dtype
    ) -> np.ndarray:
        """The stored values within ``bounds``, in memory of this process's own (never a view of the file: an array
        over it would fault if the file were truncated, and would keep a deleted step's disk space)."""
        out = _aligned(tuple(b - a for a, b in bounds), dtype)
        whole = len(pieces) == 1 and pieces[0][1] == bounds  # one stored shard holds the slice
        if whole and (start := _first(bounds, pieces[0][0]["index"])) is not None:
            shard = pieces[0][0]
            where = self._checked(shard, dtype)[0] + start * dtype.itemsize
            if not _read_into(self._fds[shard["file"]], out, where):
                raise _Damaged(f"{key}: {shard['file']} ends before byte {where + out.nbytes}")
            return out  # one copy, from the page cache straight into the slice's buffer
        filled = 0
        for shard, have in pieces:
            out[_within(have, bounds)] = self.piece(shard, dtype)[_within(have, shard["index"])]
            filled += math.prod(b - a for a, b in have)
        if filled != out.size:
            raise _Damaged(f"{key}: the stored shards cover {filled} of the {out.size} elements of {list(bounds)}")
        return out


def _aligned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An empty array whose data starts on a 64-byte boundary (what XLA's CPU client takes without a copy)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _first(have: Bounds, origin: Any) -> int | None:
    """Where ``have`` starts in the row-major block at ``origin`` (an element index), if it is one run of it.

    Examples:
        >>> _first(((1, 2), (2, 5)), [[0, 4], [0, 8]]), _first(((0, 4), (0, 4)), [[0, 4], [0, 8]])
        (10, None)
    """
    sizes = [b - a for a, b in origin]
    lengths = [b - a for a, b in have]
    outer = next((d for d in range(len(sizes)) if lengths[d] != 1), len(sizes))
    if any(lengths[d] != sizes[d] for d in range(outer + 1, len(sizes))):
        return None
    first, stride = 0, 1
    for d in reversed(range(len(sizes))):
        first += (have[d][0] - origin[d][0]) * stride
        stride *= sizes[d]
    return first


def _read_into(fd: int, out: np.ndarray, offset: int) -> bool:
    """Fills ``out`` from ``fd`` at ``offset``; False if the file ends first."""
    view = memoryview(out.reshape(-1).view(np.uint8).data)
    while view:
        done = os.preadv(fd, [view], offset)
        if done == 0:
            return False
        view, offset = view[done:], offset + done
    return True


def _overlaps(entry: dict[str, Any], bounds: Bounds) -> Iterator[tuple[dict[str, Any], Bounds]]:
    """Each stored shard of ``entry`` that overlaps ``bounds``, with the overlap."""
    for shard in entry["shards"]:
        have = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(bounds, shard["index"], strict=True))
        if all(a < b for a, b in have):
            yield shard, have


def _within(have: Bounds, origin: Any) -> tuple[slice, ...]:
    """``have`` (global bounds) as slices of a block that starts at ``origin``'s starts."""
    return tuple(slice(a - o[0], b - o[0]) for (a, b), o in zip(have, origin, strict=True))


def read_state(directory: pathlib.Path, item: dict[str, Any], *, step_dir: pathlib.Path) -> tuple[Any, list[Sums]]:
    """Reads the arrays ``item`` describes (``ShapeDtypeStruct`` s with shardings), each straight into place.

    Returns them and, per leaf in tree order, this process's part of its checksum (``None`` where
    the host cannot sum the dtype, or for a checkpoint orbax wrote: the caller sums those arrays).
    Arrays are read on a few threads: the copies to devices and the sums overlap the disk's reads.
    """
    if (directory / "_METADATA").exists() and not (directory / index_name(0)).exists():
        from torchshard._ckpt.orbax import read_state as read_orbax  # a checkpoint from before this format

        restored = read_orbax(directory, item, step_dir=step_dir)
        return restored, [None] * len(jax.tree.leaves(restored))
    try:
        stored = _Stored(directory)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(item)
        requests = [stored.request(jax.tree_util.keystr(p), a) for p, a in leaves]
        try:
            stored.open_files(requests)
            with concurrent.futures.ThreadPoolExecutor(max_workers=_READERS) as pool:
                results = list(pool.map(stored.read, requests))
        finally:
            stored.close()
    except (_Damaged, OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{step_dir}: the array data could not be read ({type(e).__name__}: {e}); the checkpoint is truncated or "
            f"corrupted; load an earlier step"
        ) from e
    return jax.tree.unflatten(treedef, [a for a, _ in results]), [s for _, s in results]
