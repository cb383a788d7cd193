"""load_safetensors: a Hugging Face safetensors checkpoint straight into shards, each process reading its own slices."""

from __future__ import annotations

import logging
import os
import pathlib

import jax

from torchshard._base.errors import CheckpointError, raise_if_any
from torchshard._bridge.module_tensors import state_dict_names
from torchshard._ckpt.restore import Destination, destination
from torchshard._ckpt.state import Target, model_of, torch_dtypes
from torchshard._ckpt.stepdir import PathLike
from torchshard._interop.hf_conversion import convert
from torchshard._interop.loading import (
    SliceBuilder,
    bind,
    check_load_args,
    destination_arrays,
    name_problems,
)
from torchshard._interop.renames import Rename, model_names
from torchshard._interop.safetensors_files import Reader, checkpoint_files, index_of
from torchshard._sharding.plan import ShardingPlan

_log = logging.getLogger("torchshard")


def _read(
    root: pathlib.Path, target: Target, dest: Destination, *, rename: Rename | None, strict: bool
) -> dict[str, jax.Array]:
    """Every destination array, checked and read (this process's slices); nothing is bound yet."""
    model, dtypes = model_of(target), torch_dtypes(target)
    expected = state_dict_names(model)
    reader = Reader(checkpoint_files(root))
    index = index_of(root)
    unindexed = reader.restrict(index) if index is not None else []
    raise_if_any(unindexed, header=f"{root} does not match its index; save or download it", error=CheckpointError)
    conversion = convert(model, {n: s.shape for n, s in reader.tensors.items()}, set(expected))
    converted = conversion.problems + reader.convert(conversion.renamed, conversion.built)
    sources, problems = model_names(list(reader.tensors), rename)
    problems = converted + problems
    chosen, found = name_problems(expected, dest, sources, reader, dtypes, strict=strict)
    header = f"checkpoint {root} does not fit {type(model).__name__}"
    raise_if_any(problems + found, header=f"{header}; pass rename= for other names, or the model it was saved from")
    kept = list(dict.fromkeys(dest.names[n] for n in expected if dest.names[n] not in chosen))
    if kept:  # strict=False: say which tensors were not in the checkpoint
        _log.info("load_safetensors: %d tensors not in %s keep the model's values: %s", len(kept), root, kept[:8])
    build = SliceBuilder(reader, sources, dtypes)
    arrays = destination_arrays(target, dest, chosen, build)
    raise_if_any(build.problems, header="checkpoint values JAX cannot hold")
    _log.info(
        "load_safetensors: this process read %d of the checkpoint's %d tensor bytes from %s",
        reader.requested,
        reader.total_bytes(),
        root,
    )
    return arrays


def load_safetensors(
    path: PathLike,
    target: Target,
    plan: ShardingPlan | None = None,
    *,
    rename: Rename | None = None,
    strict: bool = True,
) -> Target:
    """Loads a Hugging Face safetensors checkpoint into shards: the reverse of `save_safetensors`.

    ``path`` is a folder as ``save_pretrained``, `save_safetensors` or a Hub snapshot write it
    (``model.safetensors``, or shards with ``model.safetensors.index.json``) or one
    ``.safetensors`` file. Each process reads only the slices its own devices hold (safetensors'
    lazy ``get_slice``), each distinct slice once, so no process ever holds the whole model.
    Values take the model's dtypes as ``load_state_dict`` copies them (a bf16 checkpoint fills
    fp32 masters); a tied tensor is read once. Names are checked like a strict
    ``load_state_dict``: every missing, unexpected, mis-shaped and uncastable tensor at once, with
    near misses suggested, and nothing changes on error. A Trainer (scanned and pipelined stacks
    included) gets the weights with a fresh optimizer state and step 0. The bytes this process
    read are logged (``torchshard`` logger, INFO). A transformers model reads a checkpoint in the
    Hub's names through transformers' own conversion mapping, as ``from_pretrained`` does: MoE
    experts stored one by one fill the model's stacked expert tensors, each device reading only
    its experts' source tensors.

    Args:
        path: the checkpoint folder or file.
        target: a `Trainer`, a sharded module, or a module (``meta`` included) with ``plan``.
        plan: for a module not yet placed, the `ShardingPlan` to place it on.
        rename: maps each checkpoint name to the model's: a callable (None drops the tensor) or a
            list of ``(regex, replacement)`` pairs applied in order with ``re.sub``, e.g.
            ``[(r"^", "model.")]`` for a base model's checkpoint in a causal LM.
        strict: when False, missing tensors keep the model's values and unexpected ones are skipped.

    Returns:
        ``target``, now holding the checkpoint's values.

    Raises:
        ArgumentError: bad arguments, or a ``rename`` callable that raised (the name it was called with
            named, its exception the ``__cause__``); nothing is loaded.
        ShardingError: missing, unexpected, mis-shaped or uncastable tensors (all of them listed).
        CheckpointError: no such path, a folder without a checkpoint, a truncated or corrupted
            file, or an index naming a missing shard (each named).

    Examples:
        >>> import tempfile
        >>> source = torch.nn.Linear(16, 4)
        >>> folder = tempfile.mkdtemp()
        >>> _ = ts.save_safetensors(folder, ts.shard(source, ts.plan(source, ts.make_mesh({"data": 8}))))
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(16, 4)
        >>> p = ts.plan(model, ts.make_mesh({"data": 8}), [("weight", (None, "data"))])
        >>> model = load_safetensors(folder, model, p)
        >>> torch.equal(ts.to_torch_state_dict(model)["weight"], ts.to_torch_state_dict(source)["weight"])
        True
    """
    check_load_args("load_safetensors", path, target, plan, rename, strict)
    root = pathlib.Path(os.path.abspath(path))
    dest = destination(target, plan)
    arrays = _read(root, target, dest, rename=rename, strict=strict)
    bind(target, dest, arrays, plan)
    return target
