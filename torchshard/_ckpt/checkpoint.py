"""save / load: atomic sharded checkpoints of a Trainer or module that reshard onto any plan when loaded."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
import torch
from jax.experimental import multihost_utils

from torchshard._base.errors import CheckpointError, ShardingError, raise_if_any
from torchshard._base.validate import instance_problems, int_problems, raise_for_arguments
from torchshard._bridge.module_tensors import canonical_names, named_tensors
from torchshard._bridge.tensors import rebind
from torchshard._ckpt.meta import checksum_problems, metadata, read_meta, write_meta
from torchshard._ckpt.orbax import read_state, unwritable, write_state
from torchshard._ckpt.restore import (
    Destination,
    destination_arrays,
    load_trainer,
    model_item,
    placed_destination,
    plan_destination,
    recipes,
    tensor_problems,
    trainer_destination,
    trainer_problems,
    trainer_read,
)
from torchshard._ckpt.state import Target, model_of, state_tree
from torchshard._ckpt.stepdir import (
    STATE,
    TMP,
    begin,
    check_files,
    commit,
    discard,
    file_sizes,
    path_problems,
    prune,
    resolve,
    step_name,
    write_failure,
)
from torchshard._sharding.placement import assign
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.trainer import Trainer

PathLike = str | os.PathLike[str]
T = TypeVar("T")


def primary() -> bool:
    """Whether this process writes the files every process shares."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Waits for every process (a no-op in a single-process run)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def together(name: str, work: Callable[[], T]) -> T:
    """Runs ``work`` on every process, then every process raises if any process's ``work`` raised.

    A process that raised alone would leave the others waiting at the next barrier for ever: so a
    failure (a `CheckpointError`) is held until every process has reported in at ``name``, the
    failed process raises its own error and every other one a `CheckpointError` naming it.
    """
    failure: CheckpointError | None = None
    result: Any = None
    try:
        result = work()
    except CheckpointError as e:
        failure = e
    failed = [0] if failure is not None else []
    if jax.process_count() > 1:
        flags = multihost_utils.process_allgather(np.int32(failure is not None))
        failed = [i for i, flag in enumerate(np.ravel(flags)) if flag]
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(
            f"process(es) {failed} failed at {name} (their own errors say why); this process stopped with them, so no "
            f"process waits for the others; earlier steps are intact"
        )
    return result


def _target_problems(target: Any) -> list[str]:
    return instance_problems("target", target, (Trainer, torch.nn.Module), "a Trainer or a sharded torch.nn.Module")


def _check_save_args(path: Any, target: Any, step: Any, keep_last: Any) -> pathlib.Path:
    problems = _target_problems(target) + int_problems("step", step, minimum=0, none="the Trainer's step count")
    problems += int_problems("keep_last", keep_last, minimum=1, none="keep every step")
    raise_for_arguments(path_problems("path", path) + problems, header="invalid save() arguments")
    return pathlib.Path(os.path.abspath(path))  # orbax takes absolute paths only; "ckpt/" is relative to the cwd


def _begin(final: pathlib.Path) -> pathlib.Path:
    """The primary's hidden directory for this save (after recovering the root); every process's path of it."""
    if not primary():
        return final.with_name(TMP + final.name)
    try:
        return begin(final)
    except OSError as e:
        raise write_failure(final.parent, e, cleanup="nothing was written; earlier steps are intact") from e


def _write(tmp: pathlib.Path, final: pathlib.Path, tree: dict[str, Any], meta: dict[str, Any]) -> None:
    """Arrays (every process its shards), then the metadata (the commit marker, last); a failed write is undone."""
    try:
        write_state(tmp / STATE, tree)
        if primary():
            write_meta(tmp, meta | {"files": file_sizes(tmp / STATE)})
    except (OSError, ValueError) as e:  # orbax reports a full disk as ValueError("RESOURCE_EXHAUSTED: ...")
        if isinstance(e, ShardingError):
            raise
        if primary():
            with contextlib.suppress(OSError):  # best effort: the next save removes what is left
                discard(tmp)
        raise write_failure(final, e, cleanup="the partial save was removed; earlier steps are intact") from e


def _write_and_commit(
    tmp: pathlib.Path, final: pathlib.Path, tree: dict[str, Any], meta: dict[str, Any], keep_last: int | None, step: int
) -> None:
    _write(tmp, final, tree, meta)
    if primary():
        _finish(tmp, final, keep_last, step)


def _finish(tmp: pathlib.Path, final: pathlib.Path, keep_last: int | None, step: int) -> None:
    try:
        old = commit(tmp, final)
    except OSError as e:
        with contextlib.suppress(OSError):
            discard(tmp)
        raise write_failure(final, e, cleanup="the save was not committed; earlier steps are intact") from e
    try:
        discard(old)
        prune(final.parent, keep_last, saved=step)
    except OSError as e:
        raise write_failure(final.parent, e, cleanup=f"step {step} was saved, but deleting older copies failed") from e


def save(path: PathLike, target: Target, *, step: int | None = None, keep_last: int | None = None) -> pathlib.Path:
    """Saves a sharded checkpoint of a Trainer (or of a sharded module) to ``path/step_<N>``.

    A Trainer's checkpoint holds every parameter and buffer keyed by ``state_dict`` name (tied
    tensors once), the optimizer state, the step counter and the RNG base key; a module's holds
    its tensors. Each process writes its own shards (orbax). The save is crash-safe: everything
    goes to a hidden temporary directory, ``torchshard.json`` (names, shapes, dtypes and a
    checksum of every array, the size of every file) is written last, and only then is the
    directory renamed to ``step_<N>``. Saving a step again renames the old copy aside and deletes
    it only after the new one is in place; ``keep_last`` deletes a step by renaming it out of
    sight first. A kill at any point leaves only complete steps listed (`checkpoint_steps`), and
    the next save puts the leftovers right (a complete old copy is renamed back, never lost).

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
        ArgumentError: bad arguments.
        ShardingError: a module whose tensors are not placed.
        CheckpointError: the disk is full, ``path`` is a file or not writable, or another OS
            error; the partial save is removed and earlier steps are intact.

    Example:
        >>> import tempfile, optax
        >>> root = tempfile.mkdtemp()
        >>> model = torch.nn.Linear(16, 4)
        >>> loss_fn = lambda m, b: m(b).square().mean()
        >>> trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})))
        >>> _ = trainer.step(torch.randn(8, 16))
        >>> save(root, trainer, keep_last=3).name
        'step_00000001'
    """
    root = _check_save_args(path, target, step, keep_last)
    step = (target.step_count if isinstance(target, Trainer) else 0) if step is None else step
    tree = state_tree(target, doing="save()")
    raise_if_any(unwritable(tree), header="save(): nothing was written", error=CheckpointError)
    model = model_of(target)
    stacks = target.layout.stacks() if isinstance(target, Trainer) else {}
    meta = metadata(type(model).__name__, canonical_names(model), tree, step, stacks=stacks)
    final = root / step_name(step)
    tmp = together("torchshard-save-begin", lambda: _begin(final))
    together("torchshard-save-end", lambda: _write_and_commit(tmp, final, tree, meta, keep_last, step))
    return final


def _check_load_args(path: Any, target: Any, step: Any, plan: Any) -> None:
    problems = path_problems("path", path) + _target_problems(target)
    problems += int_problems("step", step, minimum=0, none="the latest")
    if plan is not None:
        problems += instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    if plan is not None and isinstance(target, Trainer):
        problems.append("plan= is for modules; a Trainer loads onto its own plan (build it with the plan you want)")
    raise_for_arguments(problems, header="invalid load() arguments")


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
        ArgumentError: bad arguments.
        ShardingError: names or shapes do not match (every missing, unexpected and mis-shaped
            tensor listed), or the optimizer state does not.
        CheckpointError: no complete checkpoint at ``path``, or it is truncated or corrupted.

    Example:
        >>> import tempfile, optax
        >>> root, model = tempfile.mkdtemp(), torch.nn.Linear(16, 4)
        >>> loss_fn = lambda m, b: m(b).square().mean()
        >>> trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})))
        >>> _ = trainer.step(torch.randn(8, 16))
        >>> _ = save(root, trainer)
        >>> other = torch.nn.Linear(16, 4)  # onto another mesh and plan
        >>> resumed = ts.Trainer(other, loss_fn, optax.sgd(0.1), ts.plan(other, ts.make_mesh({"data": 4, "model": 2}),
        ...                      [("weight", ("model", None))]))
        >>> load(root, resumed).step_count
        1
    """
    _check_load_args(path, target, step, plan)
    step_dir = resolve(pathlib.Path(os.path.abspath(path)), step)
    meta = read_meta(step_dir)
    check_files(step_dir, meta["files"])
    model = model_of(target)
    trainer = target if isinstance(target, Trainer) else None
    dest = _destination(model, trainer, plan)
    problems = tensor_problems(meta, dest)
    recipes_ = recipes(meta, dest) if not problems else {}
    item = {"model": model_item(meta, dest, recipes_)}
    trainer_plan = None
    if trainer is not None and not problems:
        trainer_plan = trainer_read(meta, trainer, recipes_, item["model"])
        item["trainer"] = trainer_plan.item
    if trainer is not None:
        problems += trainer_problems(meta, trainer_plan) if not problems else []
    header = f"checkpoint {step_dir} ({meta.get('module')}) does not fit {type(model).__name__}"
    raise_if_any(problems, header=f"{header}; load it into the architecture (and optimizer) it was saved from")
    restored = read_state(step_dir / STATE, item, step_dir=step_dir)
    raise_if_any(checksum_problems(meta, restored), header=f"{step_dir} is corrupted; load an earlier step",
                 error=CheckpointError)  # fmt: skip
    arrays = destination_arrays(recipes_, restored["model"], dest)
    if trainer is not None and trainer_plan is not None:
        load_trainer(trainer, arrays, trainer_plan.convert(restored["trainer"], trainer))
    elif plan is not None:
        assign(model, arrays, plan)
    else:
        rebind(named_tensors(model), arrays)
    return target


def _destination(model: torch.nn.Module, trainer: Trainer | None, plan: ShardingPlan | None) -> Destination:
    if trainer is not None:
        return trainer_destination(trainer)
    return plan_destination(model, plan) if plan is not None else placed_destination(model)
