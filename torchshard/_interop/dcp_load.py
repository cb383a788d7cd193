"""load_dcp: a torch.distributed.checkpoint folder (FSDP2, torchtitan, dcp.save) into shards, per process its slices."""

from __future__ import annotations

import functools
import logging
import os
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch

from torchshard._base.errors import CheckpointError, raise_if_any
from torchshard._bridge.module_tensors import state_dict_names
from torchshard._ckpt.restore import Destination, destination, load_trainer
from torchshard._ckpt.state import Target, model_of, torch_dtypes
from torchshard._ckpt.stepdir import PathLike
from torchshard._interop import dcp_names
from torchshard._interop.dcp_optim import TorchOptimizer
from torchshard._interop.loading import (
    SliceBuilder,
    bind,
    check_load_args,
    destination_arrays,
    name_problems,
)
from torchshard._interop.renames import Rename, model_names, renamer
from torchshard._sharding.plan import ShardingPlan
from torchshard._trainer.trainer import Trainer

if TYPE_CHECKING:  # dcp_io imports torch.distributed.checkpoint: see _read
    from torchshard._interop.dcp_io import BoxReader

_log = logging.getLogger("torchshard")


def _sources(entries: list[str], expected: list[str], rename: Rename | None) -> tuple[dict[str, str], list[str]]:
    """Model name → stored name, after the layout's prefix (``model.``...) is taken off and ``rename`` applied."""
    prefix = dcp_names.model_prefix(entries, expected)
    stripped = {n[len(prefix) :] if n.startswith(prefix) else n: n for n in entries}
    found, problems = model_names(list(stripped), rename)
    return {model: stripped[name] for model, name in found.items()}, problems


def _plan_reads(reader: BoxReader, dest: Destination, chosen: Mapping[str, str], sources: Mapping[str, str]) -> None:
    """Tells ``reader`` the slices of each stored tensor this process's devices hold (a scanned stack: per layer)."""
    for key, like in dest.arrays.items():
        indices: list[Any] = list(like.sharding.addressable_devices_indices_map(tuple(like.shape)).values())
        layers = dest.stacks.get(key)
        if layers is None and key in chosen:
            reader.plan(sources[chosen[key]], indices)
        for name in layers or ():
            if name in chosen:
                reader.plan(sources[chosen[name]], [i[1:] for i in indices])


class _Optimizer:
    """The AdamW state of a checkpoint mapped onto a Trainer's optax state (what maps, and what does not)."""

    def __init__(
        self, trainer: Trainer, dest: Destination, stored: Mapping[str, tuple[str, str]], rename: Rename | None
    ) -> None:
        rename_one = renamer(rename)
        self.entries = {(rename_one(p), f): n for n, (p, f) in stored.items()}
        self.trainer, self.dest = trainer, dest
        self.abstract = jax.eval_shape(trainer.transform.init, dict(trainer.state.params))
        self.slots = dcp_names.optax_slots(self.abstract, trainer.state.params)

    def layers(self, param: str) -> list[str]:
        return self.dest.stacks.get(param) or [param]

    def problems(self, reader: BoxReader, *, strict: bool) -> list[str]:
        problems = []
        shapes = self.dest.layer_shapes()
        for slot in self.slots.values():
            for layer in self.layers(slot.param) if slot.param else []:
                field = dcp_names.OPTAX_FIELDS[slot.field]
                name = self.entries.get((layer, field))
                if name is None:
                    problems += [f"missing optimizer state {layer}.{field} {shapes[layer]}"] if strict else []
                elif reader.tensors[name].shape != shapes[layer]:
                    problems.append(
                        f"mis-shaped {name}: checkpoint {reader.tensors[name].shape}, model {shapes[layer]}"
                    )
        if strict:
            problems += self._unkept()
            unmapped = dcp_names.unmapped_leaves(self.abstract, self.slots)
            problems += [
                f"optimizer state leaf {p} has no torch AdamW counterpart (exp_avg, exp_avg_sq, step)" for p in unmapped
            ]
            known = set(shapes)
            problems += [
                f"unexpected optimizer state {n}: its parameter is not in the model"
                for (param, _), n in self.entries.items()
                if param not in known
            ]
        return problems

    def _unkept(self) -> list[str]:
        """The AdamW fields the checkpoint holds and the Trainer's optimizer keeps no state for (optax.sgd: all)."""
        kept = {dcp_names.OPTAX_FIELDS[s.field] for s in self.slots.values()}
        unkept = sorted({field for _, field in self.entries} - kept)
        if not unkept:
            return []
        kind = "AdamW" if set(unkept) <= set(dcp_names.OPTAX_FIELDS.values()) else "torch optimizer"
        return [
            f"the checkpoint holds {kind} state ({', '.join(unkept)}) that the Trainer's optimizer keeps no state "
            f"for: build the Trainer with the optimizer that saved it (e.g. optax.adamw) to resume it, or load "
            f"with strict=False for the weights and step count alone"
        ]

    def step(self, reader: BoxReader, *, strict: bool) -> int | None:
        """torch's ``step`` (the same for every parameter AdamW stepped), or None if the checkpoint has none.

        Raises:
            CheckpointError: the parameters' steps differ (optax keeps one count) and ``strict``.
        """
        names = [n for (_, field), n in self.entries.items() if field == "step"]
        values = {float(reader.read(n, ())) for n in names}
        reader.release()
        if len(values) > 1 and strict:
            raise CheckpointError(
                f"the checkpoint's AdamW steps differ between parameters ({sorted(values)}); optax keeps one "
                f"count: load with strict=False to start the count at the largest"
            )
        return int(max(values)) if values else None

    def state(
        self, reader: BoxReader, params: Mapping[str, jax.Array], dtypes: Mapping[str, torch.dtype], *, strict: bool
    ) -> tuple[Any, int | None]:
        """The optax state (mapped leaves from the checkpoint, the rest as ``optimizer.init`` makes them), and step."""
        shardings = self.trainer.state_shardings()
        fresh = jax.jit(self.trainer.transform.init, out_shardings=shardings.opt_state)(dict(params))
        count = self.step(reader, strict=strict)
        leaves = {}
        for path, like in jax.tree_util.tree_leaves_with_path(fresh):
            slot = self.slots.get(jax.tree_util.keystr(path))
            if slot is not None and slot.param is None and count is not None:
                leaves[jax.tree_util.keystr(path)] = jax.device_put(np.asarray(count, like.dtype), like.sharding)
            elif slot is not None and slot.param is not None:
                array = self._array(reader, slot, like, dtypes)
                leaves |= {jax.tree_util.keystr(path): array} if array is not None else {}
        return jax.tree_util.tree_map_with_path(lambda p, x: leaves.get(jax.tree_util.keystr(p), x), fresh), count

    def _array(self, reader: BoxReader, slot: Any, like: jax.Array, dtypes: Mapping[str, torch.dtype]) -> Any:
        field = dcp_names.OPTAX_FIELDS[slot.field]
        layers = self.layers(slot.param)
        if any((n, field) not in self.entries for n in layers):
            return None  # strict=False: it keeps optimizer.init's values
        names = {n: self.entries[(n, field)] for n in layers}
        build = SliceBuilder(reader, names, {n: dtypes[n] for n in layers})  # type: ignore[arg-type]
        indices: list[Any] = list(like.sharding.addressable_devices_indices_map(tuple(like.shape)).values())
        stacked = slot.param in self.dest.stacks
        for name in names.values():
            reader.plan(name, [i[1:] for i in indices] if stacked else indices)
        struct = jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=like.sharding)
        if stacked:
            return build.stacked(struct, layers, layers[0], None)
        return build.array(struct, functools.partial(build.host, layers[0], layers[0]))


def _log_skipped(entries: dcp_names.Entries, others: list[str], target: Target, root: pathlib.Path) -> None:
    if entries.optimizer and not isinstance(target, Trainer):
        _log.info(
            "load_dcp: %d optimizer-state tensors in %s not read (the target is a module)", len(entries.optimizer), root
        )
    if entries.loop or others:
        _log.info(
            "load_dcp: training-loop state and non-tensor entries in %s not read: %s", root, (entries.loop + others)[:8]
        )


_Read = tuple[dict[str, jax.Array], "_Optimizer | TorchOptimizer | None", "BoxReader", dict[str, torch.dtype]]


def _optimizer(
    target: Target, dest: Destination, entries: dcp_names.Entries, objects: list[str], rename: Rename | None
) -> _Optimizer | TorchOptimizer | None:
    """How the checkpoint's optimizer entries map onto a Trainer's optimizer (None: nothing to map, or a module)."""
    if not isinstance(target, Trainer):
        return None
    if target.optimizer is None:
        return _Optimizer(target, dest, entries.optimizer, rename) if entries.optimizer else None
    groups = dcp_names.group_entries(objects)
    return TorchOptimizer(target, dest, entries.optimizer, groups, rename) if entries.optimizer or groups else None


def _read(root: pathlib.Path, target: Target, dest: Destination, *, rename: Rename | None, strict: bool) -> _Read:
    """Every check first (nothing read yet), then every destination array read (this process's slices)."""
    model, dtypes = model_of(target), torch_dtypes(target)
    expected = state_dict_names(model)
    # here, not at the top: torch.distributed.checkpoint (sympy, DTensor) takes 0.6 s to import, which every
    # `import torchshard` and every process a launcher starts would pay for a format most runs never read
    from torchshard._interop.dcp_io import BoxReader, read_metadata, stored_tensors

    metadata = read_metadata(root)
    reader = BoxReader(root, metadata, stored_tensors(root, metadata))
    entries = dcp_names.split(reader.tensors)
    sources, problems = _sources(entries.model, expected, rename)
    chosen, found = name_problems(expected, dest, sources, reader, dtypes, strict=strict)  # type: ignore[arg-type]
    objects = [n for n in metadata.state_dict_metadata if n not in reader.tensors]
    optimizer = _optimizer(target, dest, entries, objects, rename)
    if optimizer is not None:
        found += optimizer.problems(reader, strict=strict)
    header = f"DCP checkpoint {root} does not fit {type(model).__name__}"
    raise_if_any(
        problems + found,
        header=f"{header}; pass rename= for other names, or strict=False to load what fits",
        error=CheckpointError,
    )
    read = optimizer.groups if isinstance(optimizer, TorchOptimizer) else {}
    _log_skipped(entries, [n for n in objects if n not in read], target, root)
    _plan_reads(reader, dest, chosen, sources)
    build = SliceBuilder(reader, sources, dtypes)  # type: ignore[arg-type]
    arrays = destination_arrays(target, dest, chosen, build)
    raise_if_any(build.problems, header="checkpoint values JAX cannot hold")
    return arrays, optimizer, reader, dtypes


def load_dcp(
    path: PathLike,
    target: Target,
    plan: ShardingPlan | None = None,
    *,
    rename: Rename | None = None,
    strict: bool = True,
) -> Target:
    """Loads a ``torch.distributed.checkpoint`` (DCP) folder into shards: FSDP2, torchtitan or plain ``dcp.save``.

    Every process reads only the box of each tensor its own devices hold, through DCP's own
    ``FileSystemReader`` and a ``DefaultLoadPlanner`` that asks for that box (DCP reshards the
    stored chunks, single-rank or FSDP2/DTensor shards, into it), so no process holds the whole
    model. Names are found in any of the usual layouts: ``model.state_dict()`` saved as is,
    ``{"model": ..., "optimizer": ...}`` (``get_state_dict``, torchtitan), or another prefix. A
    Trainer on optax gets torch AdamW's ``exp_avg`` / ``exp_avg_sq`` / ``step`` as optax's ``mu``
    / ``nu`` / ``count``; a Trainer on a torch optimizer gets its own fields (``get_optimizer_state_dict``'s
    ``optimizer.state.<name>.<field>``) and the checkpoint's ``param_groups`` values into
    ``trainer.optimizer``'s groups, as ``set_optimizer_state_dict`` gives them. Either takes its
    step count from ``step`` (a checkpoint without optimizer state: a fresh one, step 0).
    Training-loop state (``train_state``, ``lr_scheduler``, ``dataloader``) and other non-tensor
    entries are not read (logged). Checked like a strict ``load_state_dict``, all problems at once
    and nothing changed on error.

    Args:
        path: the folder ``dcp.save`` wrote (its ``checkpoint_id``).
        target: a `Trainer`, a sharded module, or a module (``meta`` included) with ``plan``.
        plan: for a module not yet placed, the `ShardingPlan` to place it on.
        rename: maps each checkpoint name (layout prefix removed) to the model's, as for
            `load_safetensors`: a callable (None drops it) or ``(regex, replacement)`` pairs.
        strict: when False, missing tensors keep the target's values, unexpected ones are skipped,
            and optimizer state that does not map starts as ``optimizer.init`` makes it.

    Returns:
        ``target``, now holding the checkpoint's values.

    Raises:
        ArgumentError: bad arguments, or a ``rename`` callable that raised (the name it was called with
            named, its exception the ``__cause__``).
        CheckpointError: not a DCP folder (a file in it: its folder named); a data file missing, cut
            short or corrupted (named); missing, unexpected, mis-shaped or uncastable tensors, AdamW
            state the Trainer's optimizer does not keep (``optax.sgd``), optimizer state that does
            not map (each named with its shapes), or param groups that do not fit a torch optimizer's
            (their number, parameters, or an option that changes its state). Nothing changes on any error.

    Examples:
        >>> import tempfile
        >>> import torch.distributed.checkpoint as dcp
        >>> source, folder = torch.nn.Linear(16, 4), tempfile.mkdtemp()
        >>> _ = dcp.save({"model": source.state_dict()}, checkpoint_id=folder, no_dist=True)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(16, 4)
        >>> model = load_dcp(folder, model, ts.plan(model, ts.make_mesh({"data": 8}), [("weight", (None, "data"))]))
        >>> torch.equal(ts.to_torch_state_dict(model)["weight"], source.weight.detach())
        True
    """
    check_load_args("load_dcp", path, target, plan, rename, strict)
    root = pathlib.Path(os.path.abspath(path))
    dest = destination(target, plan)
    arrays, optimizer, reader, dtypes = _read(root, target, dest, rename=rename, strict=strict)
    if optimizer is None:
        bind(target, dest, arrays, plan)
    else:
        assert isinstance(target, Trainer)
        params = {k: arrays[k] for k in target.state.params}
        opt_state, count = optimizer.state(reader, params, dtypes, strict=strict)
        step = jax.device_put(np.int32(count or 0), target.state_shardings().step)
        load_trainer(target, arrays, {"opt_state": opt_state, "step": step, "rng": target.rng_key})
    _log.info(
        "load_dcp: this process read boxes of %d of the checkpoint's %d tensor bytes from %s",
        reader.requested,
        reader.total_bytes(),
        root,
    )
    return target
