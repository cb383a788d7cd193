"""Checkpoints: sharded orbax save/load that reshards on load, and export to plain torch / safetensors."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import torch
from jax.experimental import multihost_utils

from torchshard._errors import ShardingError, raise_if_any
from torchshard._mesh import describe_mesh
from torchshard._placement import assign, host_array, is_jax_tensor, put, rebind
from torchshard._plan import ShardingPlan, model_tensors, named_tensors, tie_groups
from torchshard._trainer import Trainer, TrainState

_FORMAT = "torchshard-checkpoint"
_VERSION = 1
_META = "torchshard.json"  # written last: a step directory without it is not a checkpoint
_STATE = "state"  # the orbax PyTree checkpoint inside a step directory
_STEP = re.compile(r"step_(\d+)")
_TMP = ".torchshard-tmp-"  # a save in progress (or interrupted); never loaded
_OLD = ".torchshard-old-"  # a step being replaced by a new save of the same step
_INDEX = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

Target = Trainer | torch.nn.Module
PathLike = str | os.PathLike[str]


class CheckpointError(ShardingError):
    """A checkpoint that cannot be read: missing, incomplete, truncated or corrupted."""


def _raise_corrupt(problems: list[str], *, header: str) -> None:
    if problems:
        raise CheckpointError(problems, header=f"{header} ({len(problems)} problem{'s' if len(problems) > 1 else ''})")


# --------------------------------------------------------------------------- what is saved


def _model_of(target: Target) -> torch.nn.Module:
    return target.model if isinstance(target, Trainer) else target


def _canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every param/buffer name (tied aliases included) → the name its tensor is stored under."""
    return tie_groups(model_tensors(model))


def _placed_arrays(model: torch.nn.Module, *, doing: str) -> dict[str, jax.Array]:
    """Canonical name → the ``jax.Array`` behind each placed tensor (tied tensors once)."""
    tensors = named_tensors(model)
    canonical = list(dict.fromkeys(_canonical_names(model).values()))
    unplaced = [n for n in canonical if not is_jax_tensor(tensors[n])]
    raise_if_any(
        [f"{n} {tuple(tensors[n].shape)}: a plain torch tensor on {tensors[n].device}" for n in unplaced],
        header=f"{doing}: {type(model).__name__} is not sharded; place it with torchshard.shard(model, plan) first",
    )
    return {n: tensors[n].jax() for n in canonical}


def _trainer_tree(trainer: Trainer) -> dict[str, Any]:
    """The non-module part of a trainer: optimizer state, step counter and RNG base key."""
    state = trainer.state
    return {"opt_state": state.opt_state, "step": state.step, "rng": trainer.rng_key}


def _state_tree(target: Target, *, doing: str) -> dict[str, Any]:
    arrays = _placed_arrays(_model_of(target), doing=doing)
    if not isinstance(target, Trainer):
        return {"model": arrays}
    state = target.state
    return {"model": {**arrays, **state.params, **state.buffers}, "trainer": _trainer_tree(target)}


# --------------------------------------------------------------------------- checksums


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words (64-bit values give two words each)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """Row-major flat index of every element (mod 2**32), built without reshaping sharded data."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index += jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


def _fingerprint(x: jax.Array) -> jax.Array:
    # Integer sums wrap exactly, so the result is the same for every sharding and reduction order;
    # the plain sum notices any single flipped bit, the position-weighted one moved values.
    words = _words(x)
    weights = _positions(words.shape) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([words.sum(dtype=jnp.uint32), (words * weights).sum(dtype=jnp.uint32)])


_fingerprints = jax.jit(lambda tree: jax.tree.map(_fingerprint, tree))


def _checksums(tree: Any) -> Any:
    """The same tree with each leaf replaced by its two uint32 checksums (a list of ints)."""
    return jax.tree.map(lambda s: [int(v) for v in s], jax.device_get(_fingerprints(tree)))


# --------------------------------------------------------------------------- metadata


def _flat(tree: Any) -> dict[str, Any]:
    """keystr path → leaf, e.g. ``"[0].mu['fc.weight']"`` for an optax state."""
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _leaves_meta(arrays: Mapping[str, jax.Array], sums: Mapping[str, list[int]]) -> dict[str, Any]:
    return {k: {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": sums[k]} for k, x in arrays.items()}


def _mesh_of(arrays: Mapping[str, jax.Array]) -> str | None:
    mesh = next((getattr(a.sharding, "mesh", None) for a in arrays.values()), None)
    return describe_mesh(mesh) if mesh is not None else None


def _metadata(target: Target, tree: dict[str, Any], step: int) -> dict[str, Any]:
    sums = _checksums(tree)
    trainer = None
    if "trainer" in tree:
        trainer = _leaves_meta(_flat(tree["trainer"]), _flat_sums(sums["trainer"]))
    return {
        "format": _FORMAT,
        "version": _VERSION,
        "step": step,
        "module": type(_model_of(target)).__name__,
        "mesh": _mesh_of(tree["model"]),
        "names": _canonical_names(_model_of(target)),
        "tensors": _leaves_meta(tree["model"], sums["model"]),
        "trainer": trainer,
    }


def _flat_sums(sums: Any) -> dict[str, list[int]]:
    is_sum = lambda x: isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) for v in x)  # noqa: E731
    flat = jax.tree_util.tree_leaves_with_path(sums, is_leaf=is_sum)
    return {jax.tree_util.keystr(p): s for p, s in flat}


def _read_meta(step_dir: pathlib.Path) -> dict[str, Any]:
    file = step_dir / _META
    try:
        meta = json.loads(file.read_text())
        if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
            raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}")
        if not isinstance(meta["files"], dict) or not all(c in meta["tensors"] for c in meta["names"].values()):
            raise ValueError("a name refers to no stored tensor")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{file} is unreadable or malformed ({type(e).__name__}: {e}); the checkpoint is corrupted "
            f"or not a torchshard checkpoint (version {_VERSION}); load an earlier step"
        ) from None
    return meta


# --------------------------------------------------------------------------- directories


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_steps(path: PathLike) -> list[int]:
    """The steps of the complete checkpoints under ``path``, oldest first.

    Interrupted saves (hidden temporary directories, step directories without
    ``torchshard.json``) are never listed.

    Args:
        path: the checkpoint root given to `save`.

    Returns:
        Sorted step numbers; empty if there are none or ``path`` does not exist.

    Example:
        >>> if checkpoint_steps("ckpt"):  # doctest: +SKIP
        ...     load("ckpt", trainer)
    """
    root = pathlib.Path(path)
    if not root.is_dir():
        return []
    found = (_STEP.fullmatch(d.name) for d in root.iterdir() if (d / _META).is_file())
    return sorted(int(m.group(1)) for m in found if m)


def _resolve(root: pathlib.Path, step: int | None) -> pathlib.Path:
    """The step directory `load` reads: ``root`` itself, its step ``step``, or its latest step."""
    if step is None and (root / _META).is_file():
        return root
    if not root.exists():
        raise CheckpointError(f"no checkpoint at {root}: the directory does not exist; check the path")
    steps = checkpoint_steps(root)
    if step is not None and step not in steps:
        raise CheckpointError(f"no complete checkpoint for step {step} under {root}; available steps: {steps}")
    if not steps:
        found = "an interrupted save" if _STEP.fullmatch(root.name) else f"no step_<N>/{_META} inside"
        raise CheckpointError(
            f"no complete checkpoint at {root} ({found}); pass the checkpoint root that save() wrote, or save one first"
        )
    return root / _step_name(steps[-1] if step is None else step)


def _primary() -> bool:
    return jax.process_index() == 0


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _remove(path: pathlib.Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _write_state(directory: pathlib.Path, tree: dict[str, Any]) -> None:
    # every process calls this; orbax writes each process's own shards and the primary finalises
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        checkpointer.save(directory, args=ocp.args.PyTreeSave(tree))


def _write_meta(directory: pathlib.Path, meta: dict[str, Any]) -> None:
    (directory / _META).write_text(json.dumps(meta, indent=1))


def _file_sizes(directory: pathlib.Path) -> dict[str, int]:
    """Relative path → size of every file orbax wrote (all processes' files; it syncs before returning)."""
    return {f.relative_to(directory).as_posix(): f.stat().st_size for f in sorted(directory.rglob("*")) if f.is_file()}


def _check_files(step_dir: pathlib.Path, meta: dict[str, Any]) -> None:
    """Catches deleted and truncated files with a stat each, before orbax reads anything."""
    problems = []
    for name, size in meta["files"].items():
        file = step_dir / _STATE / name
        found = file.stat().st_size if file.is_file() else None
        if found != size:
            problems.append(f"{_STATE}/{name}: " + ("missing" if found is None else f"{found} bytes, saved {size}"))
    _raise_corrupt(problems, header=f"{step_dir} is incomplete or truncated; load an earlier step")


def _commit(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Moves a finished save into place by renames: readers see a complete old or new step, never half."""
    old = final.with_name(_OLD + final.name)
    _remove(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _remove(old)


def _prune(root: pathlib.Path, keep_last: int | None, *, saved: int) -> None:
    """Deletes leftovers of interrupted saves, then all but the newest ``keep_last`` steps."""
    for d in root.iterdir():
        if d.name.startswith((_TMP, _OLD)):
            _remove(d)
    if keep_last is None:
        return
    others = [s for s in checkpoint_steps(root) if s != saved]
    for step in others[: max(0, len(others) - (keep_last - 1))]:
        _remove(root / _step_name(step))


def _check_save_args(target: Any, step: Any, keep_last: Any) -> None:
    problems = []
    if not isinstance(target, Trainer | torch.nn.Module):
        problems.append(f"target must be a Trainer or a sharded torch.nn.Module, got {type(target).__name__}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        problems.append(f"step={step!r} must be None or an int ≥ 0")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        problems.append(f"keep_last={keep_last!r} must be None (keep every step) or an int ≥ 1")
    raise_if_any(problems, header="invalid save() arguments")


def save(path: PathLike, target: Target, *, step: int | None = None, keep_last: int | None = None) -> pathlib.Path:
    """Saves a sharded checkpoint of a Trainer (or of a sharded module) to ``path/step_<N>``.

    A Trainer's checkpoint holds every parameter and buffer keyed by ``state_dict`` name (tied
    tensors once), the optimizer state, the step counter and the RNG base key; a module's holds
    its tensors. Each process writes its own shards (orbax). The save is atomic: everything goes
    to a hidden temporary directory, ``torchshard.json`` (names, shapes, dtypes and a checksum
    of every array) is written last, and only then is the directory renamed to ``step_<N>``. An
    interrupted save never looks like a checkpoint; the next save deletes its leftovers.

    Layout::

        path/step_00000100/torchshard.json   metadata, the commit marker
        path/step_00000100/state/            orbax PyTree: {"model": {...}, "trainer": {...}}

    Args:
        path: the checkpoint root directory (created if needed).
        target: a `Trainer`, or a module placed by `shard` / `init_sharded`.
        step: the number to save as (default: the Trainer's step count; 0 for a module).
            Saving a step that exists replaces it.
        keep_last: after saving, delete all but the newest ``keep_last`` steps (the one just
            saved is always kept); ``None`` keeps every step.

    Returns:
        The step directory written.

    Raises:
        ShardingError: bad arguments, or a module whose tensors are not placed.

    Example:
        >>> save("ckpt", trainer, keep_last=3)  # doctest: +SKIP
        PosixPath('ckpt/step_00000100')
    """
    _check_save_args(target, step, keep_last)
    root = pathlib.Path(path)
    step = (target.step_count if isinstance(target, Trainer) else 0) if step is None else step
    tree = _state_tree(target, doing="save()")
    meta = _metadata(target, tree, step)
    final = root / _step_name(step)
    tmp = root / (_TMP + final.name)
    if _primary():
        root.mkdir(parents=True, exist_ok=True)
        _remove(tmp)
        tmp.mkdir()
    _sync("torchshard-save-begin")
    _write_state(tmp / _STATE, tree)
    if _primary():
        _write_meta(tmp, meta | {"files": _file_sizes(tmp / _STATE)})
        _commit(tmp, final)
        _prune(root, keep_last, saved=step)
    _sync("torchshard-save-end")
    return final


# --------------------------------------------------------------------------- loading


@dataclasses.dataclass(frozen=True)
class _Destination:
    """Where loaded tensors go: every name → its canonical name; canonical → shape, dtype, sharding."""

    names: dict[str, str]
    arrays: dict[str, jax.ShapeDtypeStruct]


def _jax_dtype(dtype: torch.dtype) -> np.dtype:
    return host_array(torch.empty(0, dtype=dtype)).dtype


def _plan_destination(model: torch.nn.Module, plan: ShardingPlan) -> _Destination:
    have = _canonical_names(model)
    problems = [f"{n}: in the plan but not in the model" for n in plan if n not in have]
    problems += [f"{n}: in the model but not in the plan" for n in have if n not in plan]
    raise_if_any(problems, header=f"plan does not fit {type(model).__name__}; re-run plan() on this model")
    arrays = {
        e.name: jax.ShapeDtypeStruct(e.shape, _jax_dtype(e.dtype), sharding=e.sharding) for e in plan.unique_entries()
    }
    return _Destination({n: plan.canonical(n) for n in plan}, arrays)


def _placed_destination(model: torch.nn.Module) -> _Destination:
    arrays = _placed_arrays(model, doing="load() without plan=")
    abstract = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for n, a in arrays.items()}
    return _Destination(_canonical_names(model), abstract)


def _shape(shape: Any) -> str:
    return str(tuple(shape))


def _tensor_problems(meta: dict[str, Any], dest: _Destination) -> list[str]:
    """Like torch's strict ``load_state_dict``: every missing, unexpected and mis-shaped tensor."""
    saved = {n: meta["tensors"][c]["shape"] for n, c in meta["names"].items()}
    wanted = {n: dest.arrays[c].shape for n, c in dest.names.items()}
    problems = [
        f"missing {n} {_shape(s)}: in the model, not in the checkpoint" for n, s in wanted.items() if n not in saved
    ]
    problems += [
        f"unexpected {n} {_shape(s)}: in the checkpoint, not in the model" for n, s in saved.items() if n not in wanted
    ]
    problems += [
        f"mis-shaped {n}: checkpoint {_shape(saved[n])}, model {_shape(s)}"
        for n, s in wanted.items()
        if n in saved and tuple(saved[n]) != tuple(s)
    ]
    return problems + _tie_problems(meta, dest)


def _tie_problems(meta: dict[str, Any], dest: _Destination) -> list[str]:
    """Names the model ties but the checkpoint stores with different values (one would be dropped)."""
    sums = {n: meta["tensors"][c]["checksum"] for n, c in meta["names"].items()}
    return [
        f"tied {n} = {c}: one tensor in the model, different values in the checkpoint; untie them in the model"
        for n, c in dest.names.items()
        if n != c and n in sums and c in sums and sums[n] != sums[c]
    ]


def _trainer_problems(meta: dict[str, Any], trainer: Trainer) -> list[str]:
    saved = meta["trainer"]
    if saved is None:
        return [
            "the checkpoint holds no optimizer state or step (it was saved from a module); "
            "load it into the module with load(path, model), then build the Trainer"
        ]
    wanted = _flat(_trainer_tree(trainer))
    what = "optimizer/step leaf"
    problems = [f"missing {what} {p} {_shape(x.shape)}" for p, x in wanted.items() if p not in saved]
    problems += [f"unexpected {what} {p} {_shape(m['shape'])}" for p, m in saved.items() if p not in wanted]
    problems += [
        f"mis-shaped {what} {p}: checkpoint {_shape(saved[p]['shape'])}, trainer {_shape(x.shape)}"
        for p, x in wanted.items()
        if p in saved and tuple(saved[p]["shape"]) != tuple(x.shape)
    ]
    if problems:
        problems.append("the checkpoint's optimizer state differs: build the Trainer with the same optax optimizer")
    return problems


def _abstract(like: Any, stored: Mapping[str, Any]) -> jax.ShapeDtypeStruct:
    # read in the stored dtype (so its checksum can be checked), straight onto the destination sharding
    return jax.ShapeDtypeStruct(tuple(stored["shape"]), np.dtype(stored["dtype"]), sharding=like.sharding)


def _restore_item(meta: dict[str, Any], dest: _Destination, trainer: Trainer | None) -> dict[str, Any]:
    model: dict[str, jax.ShapeDtypeStruct] = {}
    for canon, like in dest.arrays.items():
        source = meta["names"][canon]
        model.setdefault(source, _abstract(like, meta["tensors"][source]))
    if trainer is None:
        return {"model": model}
    tree = _trainer_tree(trainer)
    saved = meta["trainer"]
    abstract = [_abstract(x, saved[jax.tree_util.keystr(p)]) for p, x in jax.tree_util.tree_leaves_with_path(tree)]
    return {"model": model, "trainer": jax.tree.unflatten(jax.tree.structure(tree), abstract)}


def _read_state(step_dir: pathlib.Path, item: dict[str, Any]) -> dict[str, Any]:
    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            return checkpointer.restore(step_dir / _STATE, args=args)
    except Exception as e:  # orbax and tensorstore report damage with many exception types
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{step_dir}: the array data could not be read ({type(e).__name__}: {first}); the checkpoint is "
            f"truncated or corrupted; load an earlier step"
        ) from e


def _verify(step_dir: pathlib.Path, meta: dict[str, Any], restored: dict[str, Any]) -> None:
    sums = _checksums(restored)
    bad = [n for n, s in sums["model"].items() if s != meta["tensors"][n]["checksum"]]
    if "trainer" in restored:
        bad += [p for p, s in _flat_sums(sums["trainer"]).items() if s != meta["trainer"][p]["checksum"]]
    _raise_corrupt(
        [f"{n}: checksum mismatch, the stored values are not the ones saved" for n in bad],
        header=f"{step_dir} is corrupted; load an earlier step",
    )


def _to_destination(x: jax.Array, like: Any) -> jax.Array:
    return put(x if x.dtype == like.dtype else x.astype(like.dtype), like.sharding)


def _destination_arrays(meta: dict[str, Any], dest: _Destination, restored: dict[str, Any]) -> dict[str, jax.Array]:
    """Destination canonical name → its array, in the destination's dtype and sharding."""
    arrays: dict[str, jax.Array] = {}
    for canon, like in dest.arrays.items():
        array = _to_destination(restored[meta["names"][canon]], like)
        if any(array is a for a in arrays.values()):  # tied in the checkpoint, not in the model:
            array = jnp.copy(array)  # separate buffers, or donating both to a step would fail
        arrays[canon] = array
    return arrays


def _load_trainer(trainer: Trainer, arrays: dict[str, jax.Array], restored: dict[str, Any]) -> None:
    target = _trainer_tree(trainer)
    tree = jax.tree.map(_to_destination, restored, target)
    state = trainer.state
    rebind(named_tensors(trainer.model), arrays)  # frozen params too, which are not in the TrainState
    trainer.load_state(
        TrainState(
            params={n: arrays[n] for n in state.params},
            buffers={n: arrays[n] for n in state.buffers},
            opt_state=tree["opt_state"],
            step=tree["step"],
        ),
        rng_key=tree["rng"],
    )


def _check_load_args(target: Any, step: Any, plan: Any) -> None:
    problems = []
    if not isinstance(target, Trainer | torch.nn.Module):
        problems.append(f"target must be a Trainer or a torch.nn.Module, got {type(target).__name__}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        problems.append(f"step={step!r} must be None (the latest) or an int ≥ 0")
    if plan is not None and not isinstance(plan, ShardingPlan):
        problems.append(f"plan must be a ShardingPlan from torchshard.plan(), got {type(plan).__name__}")
    if plan is not None and isinstance(target, Trainer):
        problems.append("plan= is for modules; a Trainer loads onto its own plan (build it with the plan you want)")
    raise_if_any(problems, header="invalid load() arguments")


def load(path: PathLike, target: Target, *, step: int | None = None, plan: ShardingPlan | None = None) -> Target:
    """Restores a checkpoint written by `save` into ``target``, resharding onto its plan.

    Each array is read directly into the target's sharding (orbax), so a checkpoint saved on
    one mesh or plan loads onto any other. A Trainer gets its parameters, buffers, optimizer
    state, step counter and RNG base key back, so training resumes exactly. A module gets its
    tensors (a Trainer's checkpoint loads into a bare module too). Names and shapes are checked
    like torch's strict ``load_state_dict``, and every array's checksum is verified.

    Args:
        path: a checkpoint root (the latest complete step is loaded) or one ``step_<N>`` directory.
        target: a `Trainer`, or a module: sharded already (loaded onto its tensors' current
            shardings) or, with ``plan=``, on any device (``meta`` included).
        step: load this step of the root instead of the latest.
        plan: for a module, the `ShardingPlan` to load onto.

    Returns:
        ``target``, now holding the checkpoint's values.

    Raises:
        ShardingError: names or shapes do not match (every missing, unexpected and mis-shaped
            tensor listed), or the optimizer state does not.
        CheckpointError: no complete checkpoint at ``path``, or it is truncated or corrupted.

    Example:
        >>> trainer = Trainer(model, loss_fn, optax.adamw(1e-3), plan(model, mesh, presets.fsdp()))  # doctest: +SKIP
        >>> load("ckpt", trainer).step_count  # doctest: +SKIP
        100
    """
    _check_load_args(target, step, plan)
    step_dir = _resolve(pathlib.Path(path), step)
    meta = _read_meta(step_dir)
    _check_files(step_dir, meta)
    model = _model_of(target)
    trainer = target if isinstance(target, Trainer) else None
    layout = trainer.plan if trainer is not None else plan
    dest = _plan_destination(model, layout) if layout is not None else _placed_destination(model)
    problems = _tensor_problems(meta, dest) + (_trainer_problems(meta, trainer) if trainer else [])
    header = f"checkpoint {step_dir} ({meta.get('module')}) does not fit {type(model).__name__}"
    raise_if_any(problems, header=f"{header}; load it into the architecture (and optimizer) it was saved from")
    restored = _read_state(step_dir, _restore_item(meta, dest, trainer))
    _verify(step_dir, meta, restored)
    arrays = _destination_arrays(meta, dest, restored["model"])
    if trainer is not None:
        _load_trainer(trainer, arrays, restored["trainer"])
    elif plan is not None:
        assign(model, arrays, plan)
    else:
        rebind(named_tensors(model), arrays)
    return target


# --------------------------------------------------------------------------- plain torch


def _host(array: jax.Array) -> np.ndarray:
    """The whole array on this host (gathered from the other processes when not addressable here)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _to_torch(array: jax.Array, dtype: torch.dtype) -> torch.Tensor:
    host = _host(array)
    if host.dtype.name == "bfloat16":
        tensor = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(np.array(host))  # a writable copy: torch warns on read-only numpy
    return tensor.to(dtype)


def _torch_dtypes(target: Target) -> dict[str, torch.dtype]:
    """The dtype each tensor had in torch (a Trainer's plan remembers e.g. int64 buffers JAX holds as int32)."""
    tensors = {t.name: t.tensor.dtype for t in model_tensors(_model_of(target))}
    if isinstance(target, Trainer):
        tensors |= {n: e.dtype for n, e in target.plan.entries.items()}
    return tensors


def _state_dict_names(model: torch.nn.Module) -> list[str]:
    """The keys torch's ``state_dict()`` has (persistent buffers only, tied aliases included), in order."""
    return list(model.state_dict(keep_vars=True))


def to_torch_state_dict(target: Target) -> dict[str, torch.Tensor]:
    """Gathers a sharded module's (or Trainer's) tensors into a plain CPU torch ``state_dict``.

    The result is what ``model.state_dict()`` of the unsharded torch module would be: the same
    keys in the same order, CPU tensors in the original dtypes, tied names sharing one tensor
    object. It loads with ``load_state_dict`` in a process that never imports JAX. With several
    processes every process must call it (arrays are gathered with a collective).

    Args:
        target: a `Trainer` or a sharded module.

    Returns:
        ``{name: torch.Tensor}``.

    Raises:
        ShardingError: the module's tensors are not placed.

    Example:
        >>> torch.save(to_torch_state_dict(trainer), "model.pt")  # doctest: +SKIP
        >>> MyModel().load_state_dict(torch.load("model.pt"))  # doctest: +SKIP
    """
    model = _model_of(target)
    arrays = _state_tree(target, doing="to_torch_state_dict()")["model"]
    canonical = _canonical_names(model)
    dtypes = _torch_dtypes(target)
    made: dict[str, torch.Tensor] = {}
    for name in _state_dict_names(model):
        canon = canonical[name]
        if canon not in made:
            made[canon] = _to_torch(arrays[canon], dtypes[canon])
    return {name: made[canonical[name]] for name in _state_dict_names(model)}


def from_torch_state_dict(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], plan: ShardingPlan
) -> torch.nn.Module:
    """Places a plain torch ``state_dict`` onto ``plan`` and binds it into ``model``.

    The reverse of `to_torch_state_dict`: each process places only its own shards. Names and
    shapes are checked like torch's strict ``load_state_dict``; non-persistent buffers (not in a
    ``state_dict``) keep the model's own values. ``model`` may be on ``meta`` (no memory).

    Args:
        model: the module (any device).
        state_dict: ``{name: tensor}``, e.g. from ``torch.load``.
        plan: the `ShardingPlan` of ``model``.

    Returns:
        ``model``, its tensors now sharded torchax tensors; ties stay tied.

    Raises:
        ShardingError: every missing, unexpected and mis-shaped tensor.

    Example:
        >>> with torch.device("meta"):  # doctest: +SKIP
        ...     model = MyModel()
        >>> from_torch_state_dict(model, torch.load("model.pt"), plan(model, mesh, presets.fsdp()))  # doctest: +SKIP
    """
    dest = _plan_destination(model, plan)
    tensors = named_tensors(model)
    values = {c: _value_for(c, dest, state_dict, tensors) for c in dest.arrays}
    problems = _state_dict_problems(model, state_dict, tensors)
    problems += [
        f"{c} {tuple(tensors[c].shape)}: a non-persistent buffer on meta" for c, v in values.items() if v is None
    ]
    raise_if_any(
        problems, header=f"state_dict does not fit {type(model).__name__}; load it into the model it came from"
    )
    return assign(model, {c: put(v, dest.arrays[c].sharding) for c, v in values.items()}, plan)


def _state_dict_problems(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> list[str]:
    """Like torch's strict ``load_state_dict``: every missing, unexpected and mis-shaped key."""
    required = _state_dict_names(model)
    shape = lambda t: tuple(t.shape)  # noqa: E731
    problems = [
        f"missing {n} {shape(tensors[n])}: in the model, not in the state_dict" for n in required if n not in state_dict
    ]
    problems += [
        f"unexpected {n} {shape(v)}: in the state_dict, not in the model"
        for n, v in state_dict.items()
        if n not in required
    ]
    return problems + [
        f"mis-shaped {n}: state_dict {shape(state_dict[n])}, model {shape(tensors[n])}"
        for n in required
        if n in state_dict and shape(state_dict[n]) != shape(tensors[n])
    ]


def _value_for(
    canon: str, dest: _Destination, state_dict: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    """The state_dict value of a tensor under any of its tied names, else the model's own (None on meta)."""
    for name, c in dest.names.items():
        if c == canon and name in state_dict:
            return state_dict[name]
    own = tensors[canon]
    return None if own.device.type == "meta" else own


# --------------------------------------------------------------------------- safetensors


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
        >>> save_safetensors("export", trainer, max_shard_bytes=2 * 10**9)  # doctest: +SKIP
        PosixPath('export/model.safetensors.index.json')
    """
    import safetensors.torch

    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ShardingError(f"save_safetensors(max_shard_bytes={max_shard_bytes!r}): must be an int ≥ 1")
    model = _model_of(target)
    arrays = _state_tree(target, doing="save_safetensors()")["model"]
    canonical = _canonical_names(model)
    dtypes = _torch_dtypes(target)
    stored = [n for n in dict.fromkeys(canonical[n] for n in _state_dict_names(model))]
    sizes = {n: arrays[n].size * dtypes[n].itemsize for n in stored}
    shards = _shards(sizes, max_shard_bytes)
    out = pathlib.Path(path)
    if _primary():
        out.mkdir(parents=True, exist_ok=True)
        for old in out.iterdir():
            if _SHARD_FILE.fullmatch(old.name) or old.name == _INDEX:
                old.unlink()
    weight_map = {}
    for i, names in enumerate(shards):
        tensors = {n: _to_torch(arrays[n], dtypes[n]).contiguous() for n in names}
        if _primary():
            safetensors.torch.save_file(tensors, out / _shard_name(i, len(shards)), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, _shard_name(i, len(shards)))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    if _primary():
        (out / _INDEX).write_text(json.dumps(index, indent=2))
    _sync("torchshard-safetensors-end")
    return out / _INDEX
