"""HF-style sharded safetensors export of a sharded module or Trainer."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from torchshard._base.validate import int_problems, raise_for_arguments
from torchshard._bridge.module_tensors import canonical_names, custom_state_dict, state_dict_names
from torchshard._ckpt.processes import primary, together
from torchshard._ckpt.state import Target, export_arrays, model_of, target_problems, torch_dtypes
from torchshard._ckpt.stepdir import TMP, PathLike, commit, discard, path_problems, settle, write_failure
from torchshard._interop.export import torch_state_dict, torch_tensor

_INDEX = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy HF-style packing in order; a tensor bigger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _check_args(path: Any, target: Any, max_shard_bytes: Any) -> None:
    problems = path_problems("path", path)
    problems += target_problems(target)
    problems += int_problems("max_shard_bytes", max_shard_bytes, minimum=1)
    raise_for_arguments(problems, header="invalid save_safetensors() arguments")


def _link(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    try:
        os.link(source, destination, follow_symlinks=False)
    except OSError:  # another filesystem, or links not supported
        shutil.copy2(source, destination, follow_symlinks=False)


def _carry(item: pathlib.Path, destination: pathlib.Path) -> None:
    """Puts ``item`` (a file, link or folder of the previous export) into the new one without copying data."""
    if item.is_dir() and not item.is_symlink():
        shutil.copytree(item, destination, symlinks=True, copy_function=_link)
    else:
        _link(item, destination)


def _begin(out: pathlib.Path) -> pathlib.Path:
    """A fresh, empty hidden directory next to ``out`` (a previous export cut between its renames put right first)."""
    if os.path.lexists(out) and not out.is_dir():
        raise FileExistsError(errno.EEXIST, f"{out} is a file")
    os.makedirs(out.parent, exist_ok=True)
    settle(out, complete=os.path.lexists)  # a previous export cut between its renames is renamed back
    staging = out.with_name(TMP + out.name)
    os.mkdir(staging)
    return staging


def _carry_rest(out: pathlib.Path, staging: pathlib.Path, replaced: Callable[[str], bool]) -> None:
    """Links into ``staging`` every entry of ``out`` the new export neither wrote nor replaces (config.json, ...).

    After the write, so that no file is written through a link into the previous export's copy.
    """
    for item in sorted(out.iterdir()) if out.is_dir() else []:
        if not (os.path.lexists(staging / item.name) or replaced(item.name)):
            _carry(item, staging / item.name)


def _replaced_by_export(name: str) -> bool:
    return bool(_SHARD_FILE.fullmatch(name)) or name == _INDEX


def staged_write(
    out: pathlib.Path, write: Callable[[pathlib.Path | None], None], *, replaced: Callable[[str], bool]
) -> None:
    """Runs ``write(staging)`` into a hidden directory beside ``out`` (``write(None)`` on the other processes,
    which must still run any collective the write needs), then puts it in place of ``out`` by renames.

    The other entries of ``out`` are kept (linked, not copied) unless ``replaced(name)``. On any
    failure the staging directory is removed and ``out`` is as it was (absent if it was absent).

    Raises:
        CheckpointError: the write failed (full disk, no permission, a file in the way), naming ``out``.
    """
    import safetensors

    staging = None
    try:
        staging = _begin(out) if primary() else None
        write(staging)
        if staging is not None:
            _carry_rest(out, staging, replaced)
            _swap(staging, out)
    except Exception as e:  # whatever error stopped the write (a library's own too), nothing is left behind
        if staging is not None:
            with contextlib.suppress(OSError):
                discard(staging)
        if isinstance(e, OSError | safetensors.SafetensorError):
            raise write_failure(out, e, cleanup="the previous export is intact") from e
        raise  # a CheckpointError (a tensor torch cannot hold) names itself


Files = Iterator[tuple[str, dict[str, torch.Tensor]]]


def _export(target: Target, max_shard_bytes: int) -> tuple[Files, str]:
    """The files (name → tensors) and the index JSON of an export."""
    model = model_of(target)
    if custom_state_dict(model):
        return _computed(torch_state_dict(target, doing="save_safetensors()"), max_shard_bytes)
    arrays = export_arrays(target, doing="save_safetensors()")
    canonical = canonical_names(model)
    dtypes = torch_dtypes(target)
    stored = [n for n in dict.fromkeys(canonical[n] for n in state_dict_names(model))]
    sizes = {n: arrays[n].size * dtypes[n].itemsize for n in stored}
    pairs = _files(sizes, max_shard_bytes)
    # gathered lazily, one file at a time: host memory holds one file's tensors
    files = ((f, {n: torch_tensor(arrays[n], dtypes[n], name=n).contiguous() for n in s}) for f, s in pairs)
    return files, _index(sizes, pairs)


def _computed(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> tuple[Files, str]:
    """An export of a state_dict that the module's own code computed (hooks): tied tensors once, each a copy."""
    first: dict[int, str] = {}
    for name, tensor in state.items():
        first.setdefault(id(tensor), name)  # a tied tensor is stored under its first name
    stored = list(first.values())
    sizes = {n: state[n].numel() * state[n].element_size() for n in stored}
    pairs = _files(sizes, max_shard_bytes)
    # a copy each: tensors a hook split from one (views of one storage) cannot share a safetensors file
    files = ((f, {n: state[n].detach().clone(memory_format=torch.contiguous_format) for n in s}) for f, s in pairs)
    return files, _index(sizes, pairs)


def _files(sizes: Mapping[str, int], max_shard_bytes: int) -> list[tuple[str, list[str]]]:
    shards = _shards(sizes, max_shard_bytes)
    return [(_shard_name(i, len(shards)), s) for i, s in enumerate(shards)]


def _index(sizes: Mapping[str, int], pairs: list[tuple[str, list[str]]]) -> str:
    weight_map = {n: f for f, s in pairs for n in s}
    return json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2)


def _write(staging: pathlib.Path | None, files: Files, index: str) -> None:
    import safetensors.torch

    for name, tensors in files:  # gathering is a collective: every process runs it
        if staging is not None:
            safetensors.torch.save_file(tensors, staging / name, metadata={"format": "pt"})
    if staging is not None:
        (staging / _INDEX).write_text(index)


def _swap(staging: pathlib.Path, out: pathlib.Path) -> None:
    here = os.getcwd()
    old = commit(staging, out)
    if pathlib.Path(here).is_relative_to(out):  # the process would be left inside the old copy, deleted next
        os.chdir(here)
    discard(old)


def _export_files(out: pathlib.Path, files: Files, index: str, also: Callable[[pathlib.Path], None] | None) -> None:
    def write(staging: pathlib.Path | None) -> None:
        _write(staging, files, index)
        if staging is not None and also is not None:
            also(staging)

    staged_write(out, write, replaced=_replaced_by_export)


def save_safetensors(path: PathLike, target: Target, *, max_shard_bytes: int = 5 * 10**9) -> pathlib.Path:
    """Writes HF-style sharded safetensors: ``model-0000i-of-0000N.safetensors`` + the index.

    Tensors are stored under their ``state_dict`` names, tied tensors once (under the first name,
    as transformers' ``save_pretrained`` does); ``model.safetensors.index.json`` maps each stored
    name to its file. The index is written even for a single shard. Tensors are gathered one
    shard at a time, so host memory holds at most one shard. Only process 0 writes files.

    The export is atomic: it is written into a hidden directory next to ``path`` (holding links
    to the other files already in ``path``, such as ``config.json``), which then replaces
    ``path`` by renames; the previous export stays whole until the new one is complete. A
    failed or killed export leaves the previous one (if killed in the instant between the two
    renames, as ``.torchshard-old-<name>``, which the next export renames back).

    Args:
        path: the output directory (created; earlier ``model-*.safetensors`` files there are replaced,
            other files are kept).
        target: a `Trainer` or a sharded module.
        max_shard_bytes: the most bytes per file (a bigger tensor gets a file of its own).

    Returns:
        The index file's path.

    Raises:
        ArgumentError: bad ``path``, ``target`` or ``max_shard_bytes``.
        ShardingError: a module whose tensors are not placed.
        CheckpointError: the disk is full, ``path`` is a file or not writable, or another OS
            error; the previous export is intact.

    Examples:
        >>> import tempfile
        >>> model = torch.nn.Linear(16, 4)
        >>> _ = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
        >>> save_safetensors(tempfile.mkdtemp(), model, max_shard_bytes=2 * 10**9).name
        'model.safetensors.index.json'
    """
    _check_args(path, target, max_shard_bytes)
    files, index = _export(target, max_shard_bytes)
    out = pathlib.Path(os.path.abspath(path))
    together("torchshard-safetensors-end", lambda: _export_files(out, files, index, None))
    return pathlib.Path(path) / _INDEX


def export_arrays_as(
    path: PathLike,
    arrays: Mapping[str, Any],
    dtypes: Mapping[str, torch.dtype],
    *,
    max_shard_bytes: int,
    also: Callable[[pathlib.Path], None] | None = None,
) -> pathlib.Path:
    """Writes ``name → placed array`` (gathered a file at a time, in ``dtypes``) as `save_safetensors` writes one;
    ``also(folder)`` writes more files into the export before it is put in place (process 0 only)."""
    sizes = {n: arrays[n].size * dtypes[n].itemsize for n in arrays}
    pairs = _files(sizes, max_shard_bytes)
    files = ((f, {n: torch_tensor(arrays[n], dtypes[n], name=n).contiguous() for n in s}) for f, s in pairs)
    out = pathlib.Path(os.path.abspath(path))
    together("torchshard-safetensors-end", lambda: _export_files(out, files, _index(sizes, pairs), also))
    return pathlib.Path(path) / _INDEX
