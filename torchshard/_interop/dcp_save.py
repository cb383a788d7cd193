"""save_dcp: a sharded module or Trainer as a torch.distributed.checkpoint folder, each process writing its shards."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch

from torchshard._base.errors import CheckpointError
from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.module_tensors import canonical_names, custom_state_dict, state_dict_names
from torchshard._bridge.tensors import to_torch
from torchshard._ckpt.processes import primary, together
from torchshard._ckpt.state import Target, export_arrays, model_of, target_problems, torch_dtypes
from torchshard._ckpt.stepdir import TMP, PathLike, commit, discard, path_problems, settle, write_failure
from torchshard._interop import dcp_names
from torchshard._interop.dcp_optim import torch_entries
from torchshard._interop.safetensors_files import normalized
from torchshard._multihost.agree import gathered
from torchshard._trainer.trainer import Trainer

if TYPE_CHECKING:  # dcp_io imports torch.distributed.checkpoint: see _write
    from torchshard._interop.dcp_io import Chunk


def _check_args(path: Any, target: Any) -> None:
    problems = path_problems("path", path)
    problems += target_problems(target)
    if isinstance(target, torch.nn.Module) and custom_state_dict(target):
        problems.append(
            f"{type(target).__name__} changes its state_dict with hooks; save_dcp writes the tensors "
            f"as they are placed: export with save_safetensors() instead"
        )
    raise_for_arguments(problems, header="invalid save_dcp() arguments")


def _owned(array: jax.Array, dtype: torch.dtype, name: str) -> Iterator[Chunk]:
    """The distinct shards of ``array`` this process writes: each by the first process holding it."""
    from torchshard._interop.dcp_io import Chunk  # see _write

    shape = tuple(array.shape)
    owner: dict[Any, int] = {}
    for device, index in array.sharding.devices_indices_map(shape).items():
        owner.setdefault(normalized(index, shape), device.process_index)  # type: ignore[attr-defined]
    done = set()
    for shard in array.addressable_shards:
        key = normalized(shard.index, shape)
        if owner[key] == jax.process_index() and key not in done:
            done.add(key)
            offsets = tuple(start for start, _, _ in key)
            yield Chunk(name, shape, offsets, to_torch(np.asarray(shard.data), dtype).contiguous())


def _optimizer_arrays(trainer: Trainer) -> dict[str, tuple[jax.Array, torch.dtype]]:
    """``optimizer.state.<name>.<field>`` → array, for the AdamW state optax holds (scanned stacks per layer)."""
    state = trainer.state.opt_state
    slots = dcp_names.optax_slots(state, trainer.state.params)
    leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}
    stacks = trainer.layout.stacks()
    dtypes = torch_dtypes(trainer)
    found: dict[str, tuple[jax.Array, torch.dtype]] = {}
    count = next((leaves[p] for p, s in slots.items() if s.field == "count"), None)
    for path, slot in slots.items():
        if slot.param is None:
            continue
        layers = stacks.get(slot.param)
        for i, name in enumerate(layers or [slot.param]):
            array = leaves[path][i] if layers else leaves[path]
            found[f"optimizer.state.{name}.{dcp_names.OPTAX_FIELDS[slot.field]}"] = (array, dtypes[name])
            if count is not None:  # torch AdamW keeps a float step per parameter
                found[f"optimizer.state.{name}.step"] = (count, torch.float32)
    return found


def _chunks(target: Target) -> Iterator[Chunk]:
    """Every chunk this process writes: ``model.<state_dict name>`` (tied names each), then the optimizer state."""
    model = model_of(target)
    arrays, dtypes, canonical = export_arrays(target, doing="save_dcp()"), torch_dtypes(target), canonical_names(model)
    for name in state_dict_names(model):
        yield from _owned(arrays[canonical[name]], dtypes[canonical[name]], f"model.{name}")
    if isinstance(target, Trainer) and target.optimizer is not None:
        for name, array in torch_entries(target)[0].items():
            yield from _owned(array, getattr(torch, np.dtype(array.dtype).name), name)
    elif isinstance(target, Trainer):
        for name, (array, dtype) in _optimizer_arrays(target).items():
            yield from _owned(array, dtype, name)


def _objects(target: Target) -> tuple[list[Chunk], dict[str, Any]]:
    """What process 0 alone writes: a torch optimizer's param groups (a tensor value, such as a tensor ``lr``, as
    a tensor entry, which is where DCP's loader looks for it)."""
    from torchshard._interop.dcp_io import Chunk  # see _write

    if not (isinstance(target, Trainer) and target.optimizer is not None and primary()):
        return [], {}
    objects = torch_entries(target)[1]
    tensors = {n: v.detach().cpu().contiguous() for n, v in objects.items() if isinstance(v, torch.Tensor)}
    chunks = [Chunk(n, tuple(t.shape), (0,) * t.ndim, t) for n, t in tensors.items()]
    return chunks, {n: v for n, v in objects.items() if n not in tensors}


def _begin(out: pathlib.Path, staging: pathlib.Path) -> str:
    """Process 0 makes the staging folder; returns why it could not ("" when it could)."""
    if not primary():
        return ""
    if os.path.lexists(out) and not out.is_dir():
        return f"{out} is a file; save_dcp writes a folder: pass another path"
    try:
        os.makedirs(out.parent, exist_ok=True)
        settle(out, complete=os.path.lexists)
        os.mkdir(staging)
    except OSError as e:
        return str(write_failure(out, e, cleanup="nothing was written"))
    return ""


def _write(out: pathlib.Path, target: Target) -> None:
    # here, not at the top: torch.distributed.checkpoint (sympy, DTensor) takes 0.6 s to import, which every
    # `import torchshard` and every process a launcher starts would pay for a format most runs never write
    from torchshard._interop.dcp_io import write_chunks

    staging = out.with_name(TMP + out.name)
    chunks = list(_chunks(target))  # before the staging folder is made: a module that cannot be saved leaves none
    scalars, objects = _objects(target)
    # every process meets here, failed or not: the staging folder exists before any process writes
    if problem := next(filter(None, gathered("dcp-save-begin", _begin(out, staging))), ""):
        raise CheckpointError(problem)
    try:
        write_chunks(staging, chunks + scalars, rank=jax.process_index(), coordinator=primary(), objects=objects)
    except OSError as e:
        if primary():
            discard(staging)
        raise write_failure(out, e, cleanup="the previous checkpoint is intact") from e
    if primary():
        discard(commit(staging, out))


def save_dcp(path: PathLike, target: Target) -> pathlib.Path:
    """Writes a ``torch.distributed.checkpoint`` (DCP) folder that plain ``dcp.load`` reads (FSDP2, torchtitan).

    The layout is ``get_state_dict``'s: ``{"model": model.state_dict(), "optimizer": ...}``, so
    ``dcp.load({"model": model.state_dict()}, checkpoint_id=path)`` fills a torch model, FSDP2- or
    DTensor-sharded on any number of ranks or not at all. Every ``state_dict`` name is written
    (tied ones each), in the model's torch dtypes. A Trainer on a torch optimizer also writes its
    state as ``get_optimizer_state_dict`` names it (``optimizer.state.<name>.<field>``, each
    parameter by its name in ``model.named_parameters()``, a scanned stack per layer) and its
    param groups (``optimizer.param_groups.<i>.<key>``, ``params`` as names), so torch's
    ``dcp.load`` + ``set_optimizer_state_dict`` resume it. A Trainer on optax writes its AdamW
    state as torch AdamW's ``optimizer.state.<name>.exp_avg`` / ``exp_avg_sq`` / ``step`` (hyper-
    parameters live in optax, not in the state: build the torch optimizer with the same ones and
    load with ``DefaultLoadPlanner(allow_partial_load=True)``). Each process writes the distinct
    shards it is the first to hold, through DCP's ``FileSystemWriter`` and ``DefaultSavePlanner``;
    process 0 writes ``.metadata``. The folder is written beside ``path`` and renamed into place,
    so an earlier checkpoint there stays whole until the new one is complete.

    Args:
        path: the output folder (replaced if it exists).
        target: a `Trainer` or a sharded module.

    Returns:
        The folder's path.

    Raises:
        ArgumentError: bad arguments, or a module whose state_dict hooks change its tensors.
        ShardingError: a module whose tensors are not placed.
        CheckpointError: the disk is full, ``path`` is a file, or another OS error; the previous
            checkpoint is intact and nothing of the new one is left behind.

    Examples:
        >>> import tempfile
        >>> import torch.distributed.checkpoint as dcp
        >>> model = torch.nn.Linear(16, 4)
        >>> _ = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8}), [("weight", (None, "data"))]))
        >>> folder = save_dcp(tempfile.mkdtemp(), model)
        >>> plain = {"model": torch.nn.Linear(16, 4).state_dict()}
        >>> dcp.load(plain, checkpoint_id=folder, no_dist=True)
        >>> torch.equal(plain["model"]["weight"], ts.to_torch_state_dict(model)["weight"])
        True
    """
    _check_args(path, target)
    out = pathlib.Path(os.path.abspath(path))
    together("torchshard-dcp-end", lambda: _write(out, target))
    return out
