"""HF-style sharded safetensors export of a sharded module or Trainer."""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Mapping

from torchshard._checkpoint import primary, sync
from torchshard._ckpt_state import Target, model_of, state_tree, torch_dtypes
from torchshard._errors import ShardingError
from torchshard._export import torch_tensor
from torchshard._module_tensors import canonical_names, state_dict_names

_INDEX = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
PathLike = str | os.PathLike[str]


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


def save_safetensors(path: PathLike, target: Target, *, max_shard_bytes: int = 5 * 10**9) -> pathlib.Path:
    """Writes HF-style sharded safetensors: ``model-0000i-of-0000N.safetensors`` + the index.

    Tensors are stored under their ``state_dict`` names, tied tensors once (under the first name,
    as transformers' ``save_pretrained`` does); ``model.safetensors.index.json`` maps each stored
    name to its file. The index is written even for a single shard. Tensors are gathered one
    shard at a time, so host memory holds at most one shard. Only process 0 writes files.

    Args:
        path: the output directory (created; earlier ``model-*.safetensors`` files there are replaced).
        target: a `Trainer` or a sharded module.
        max_shard_bytes: the most bytes per file (a bigger tensor gets a file of its own).

    Returns:
        The index file's path.

    Raises:
        ShardingError: bad ``max_shard_bytes``, or a module whose tensors are not placed.

    Example:
        >>> import tempfile
        >>> model = torch.nn.Linear(16, 4)
        >>> _ = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
        >>> save_safetensors(tempfile.mkdtemp(), model, max_shard_bytes=2 * 10**9).name
        'model.safetensors.index.json'
    """
    import safetensors.torch

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ShardingError(f"save_safetensors(max_shard_bytes={max_shard_bytes!r}): must be an int ≥ 1")
    model = model_of(target)
    arrays = state_tree(target, doing="save_safetensors()")["model"]
    canonical = canonical_names(model)
    dtypes = torch_dtypes(target)
    stored = [n for n in dict.fromkeys(canonical[n] for n in state_dict_names(model))]
    sizes = {n: arrays[n].size * dtypes[n].itemsize for n in stored}
    shards = _shards(sizes, max_shard_bytes)
    out = pathlib.Path(path)
    if primary():
        out.mkdir(parents=True, exist_ok=True)
        for old in out.iterdir():
            if _SHARD_FILE.fullmatch(old.name) or old.name == _INDEX:
                old.unlink()
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        tensors = {n: torch_tensor(arrays[n], dtypes[n]).contiguous() for n in names}
        if primary():
            safetensors.torch.save_file(tensors, out / _shard_name(i, len(shards)), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, _shard_name(i, len(shards)))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    if primary():
        (out / _INDEX).write_text(json.dumps(index, indent=2))
    sync("torchshard-safetensors-end")
    return out / _INDEX
