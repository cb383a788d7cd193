"""Hugging Face safetensors checkpoints read lazily: which file holds each tensor, and slices of it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

from torchshard._base.errors import CheckpointError, raise_if_any
from torchshard._interop.hf_conversion import Node, leaves

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# safetensors' dtype names (its header's "dtype" field) and the torch dtypes they hold
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor of a checkpoint: the file it is in, its shape and its safetensors dtype."""

    file: pathlib.Path
    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        torch_dtype = DTYPES.get(self.dtype)
        return torch_dtype.itemsize if torch_dtype is not None else 0


def _missing(path: pathlib.Path) -> CheckpointError:
    parent = next((p for p in path.parents if p.exists()), None)
    return CheckpointError(
        f"{path} does not exist (the nearest existing folder is {parent}); pass the directory save_pretrained, "
        f"save_safetensors or a Hub download wrote, or one .safetensors file"
    )


def checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint: a single file, a folder's ``model.safetensors``, or its index's shards.

    Raises:
        CheckpointError: no such path, a folder without either file, an unreadable index, or one
            naming a shard that is not there.
    """
    if not path.exists():
        raise _missing(path)
    if path.is_file():
        return [path]
    if (path / INDEX).exists():
        return sorted(set(_indexed(path / INDEX).values()))
    if (path / SINGLE).exists():
        return [path / SINGLE]
    held = sorted(p.name for p in path.iterdir())[:10]
    raise CheckpointError(
        f"{path} holds neither {SINGLE} nor {INDEX} (it holds {held}); pass a folder in Hugging Face's layout or one "
        f".safetensors file"
    )


def _indexed(index: pathlib.Path) -> dict[str, pathlib.Path]:
    """tensor name → shard file, from ``model.safetensors.index.json``."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise TypeError("weight_map is not a map of tensor name → file name")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{index} is unreadable or malformed ({type(e).__name__}: {e}); write it again (save_pretrained)"
        ) from None
    files = {n: index.parent / f for n, f in weight_map.items()}
    absent = sorted({f.name for f in files.values() if not f.is_file()})
    raise_if_any(
        [f"{name}: named by the index, not in {index.parent}" for name in absent],
        header=f"{index} names shard files that are missing; download or copy them again",
        error=CheckpointError,
    )
    return files


class Reader:
    """Safetensors files: the header of every tensor, and slices read on request (their bytes counted).

    A file stays open (memory-mapped) only while its tensors are read: `release` closes it, so the
    pages read leave this process's memory once their values are on the devices.
    """

    def __init__(self, files: list[pathlib.Path]) -> None:
        from safetensors import SafetensorError

        self._handles: dict[pathlib.Path, Any] = {}
        self.tensors: dict[str, Stored] = {}
        self.requested = 0  # bytes of the slices read so far
        problems = []
        for file in files:
            try:
                handle = self._open(file)
            except (OSError, SafetensorError) as e:
                problems.append(f"{file}: {type(e).__name__}: {e}")
                continue
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                view = handle.get_slice(name)
                self.tensors[name] = Stored(file, tuple(view.get_shape()), view.get_dtype())
            self.release()
        self._stored = self.tensors  # the stored tensors under their stored names; `convert` renames `tensors`
        self._origin: dict[str, str] = {}
        self._built: dict[str, Node] = {}
        raise_if_any(
            problems,
            header="unreadable safetensors files (truncated, corrupted or not safetensors); download or save them",
            error=CheckpointError,
        )

    def _open(self, file: pathlib.Path) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(os.fspath(file), framework="pt")
        return self._handles[file]

    def release(self) -> None:
        """Closes the open files (unmapping them); a later read opens its file again."""
        self._handles.clear()

    def restrict(self, index: Mapping[str, pathlib.Path]) -> list[str]:
        """Keeps the tensors the index names; every name it puts in a file that lacks it is a problem."""
        wrong = [
            f"{n}: the index puts it in {f.name}, which does not hold it"
            for n, f in index.items()
            if n not in self.tensors or self.tensors[n].file != f
        ]
        self.tensors = self._stored = {n: s for n, s in self.tensors.items() if n in index}
        return wrong

    def convert(self, renamed: Mapping[str, str], built: Mapping[str, Node]) -> list[str]:
        """Names the tensors as the model does: ``renamed`` (model name → stored name) and ``built`` ones, each
        read from the slices of its stored parts that a read needs; a built one whose parts differ in dtype is
        a problem."""
        stored = self._stored
        self._origin = dict(renamed)
        self._built = dict(built)
        self.tensors = {new: stored[old] for new, old in renamed.items()}
        problems = []
        for name, node in built.items():
            parts = [stored[n] for n in leaves(node)]
            if len(dtypes := sorted({p.dtype for p in parts})) > 1:
                problems.append(f"{name}: built from stored tensors of dtypes {dtypes} ({leaves(node)[0]}, ...)")
            self.tensors[name] = Stored(parts[0].file, node.shape, parts[0].dtype)
        return problems

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]`` as a CPU torch tensor in the stored dtype (a built tensor from its parts' slices)."""
        if name in self._built:
            return self._built[name].read(self._read, index)
        return self._read(self._origin.get(name, name), index)

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        stored = self._stored[name]
        view = self._open(stored.file).get_slice(name)
        try:
            part = view[index] if stored.shape else view[()]
        except Exception as e:  # the header said one thing, the data another
            raise CheckpointError(
                f"{stored.file}: reading {name} {stored.shape} failed ({type(e).__name__}: {e}); the file is "
                f"corrupted, download or save it again"
            ) from e
        self.requested += math.prod(part.shape) * stored.itemsize
        return part

    def total_bytes(self) -> int:
        """The bytes of every tensor in the checkpoint."""
        return sum(math.prod(s.shape) * s.itemsize for s in self._stored.values())


def index_of(path: pathlib.Path) -> dict[str, pathlib.Path] | None:
    """The index's tensor → file map when ``path`` is a folder with one, else None."""
    return _indexed(path / INDEX) if path.is_dir() and (path / INDEX).exists() else None


def normalized(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """A hashable form of an array index (equal for equal slices however they are spelt)."""
    return tuple(s.indices(d) for s, d in zip(index, shape, strict=False))
