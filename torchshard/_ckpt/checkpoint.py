"""save / load: atomic sharded checkpoints of a Trainer or module that reshard onto any plan when loaded."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import pathlib
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import jax
import torch

from torchshard._base.errors import CheckpointError, ShardingError, raise_if_any
from torchshard._base.validate import instance_problems, int_problems, raise_for_arguments
from torchshard._bridge.module_tensors import canonical_names, named_tensors
from torchshard._bridge.tensors import rebind
from torchshard._ckpt import pending
from torchshard._ckpt.checksum import Started, finish_checksums, start_checksums
from torchshard._ckpt.datastate import data_entry, data_problems, read_data, restore_data, snapshot_data, write_data
from torchshard._ckpt.meta import checksum_problems, metadata, read_meta, write_meta
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
from torchshard._ckpt.shards import read_state, unwritable, write_state
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
    recorded_sizes,
    resolve,
    step_name,
    write_failure,
)
from torchshard._multihost.agree import flagged_processes, gathered
from torchshard._sharding.placement import assign
from torchshard._sharding.plan import ShardingPlan
from torchshard._trainer.trainer import Trainer

PathLike = str | os.PathLike[str]
_SAVES = itertools.count()  # every process saves in the same order: the n-th save's barriers are unique and agree
T = TypeVar("T")


def primary() -> bool:
    """Whether this process writes the files every process shares."""
    return jax.process_index() == 0


def together(name: str, work: Callable[[], T]) -> T:
    """Runs ``work`` on every process, then every process raises if any process's ``work`` raised.

    A process that raised alone would leave the others waiting at the next barrier for ever: so a
    failure (a `CheckpointError`) is held until every process has reported in at ``name``, the
    failed process raises its own error and every other one a `CheckpointError` naming it. The
    processes meet at the coordination service, not at a device collective, so this is safe on a
    background save's thread too.
    """
    failure: CheckpointError | None = None
    result: Any = None
    try:
        result = work()
    except CheckpointError as e:
        failure = e
    failed = flagged_processes(name, failure is not None)
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


def _check_save_args(path: Any, target: Any, step: Any, keep_last: Any, background: Any, data: Any) -> pathlib.Path:
    problems = _target_problems(target) + int_problems("step", step, minimum=0, none="the Trainer's step count")
    problems += data_problems(data)
    problems += int_problems("keep_last", keep_last, minimum=1, none="keep every step")
    if not isinstance(background, bool):
        problems.append(f"background={background!r} must be True or False")
    raise_for_arguments(path_problems("path", path) + problems, header="invalid save() arguments")
    return pathlib.Path(os.path.abspath(path))  # "ckpt/" is relative to the cwd, which may change before a load


def _begin(final: pathlib.Path) -> pathlib.Path:
    """The primary's hidden directory for this save (after recovering the root); every process's path of it."""
    if not primary():
        return final.with_name(TMP + final.name)
    try:
        return begin(final)
    except OSError as e:
        raise write_failure(final.parent, e, cleanup="nothing was written; earlier steps are intact") from e


@dataclasses.dataclass(frozen=True)
class _Save:
    """One save, snapshotted: the arrays and everything else it writes, none of which changes once taken.

    ``checksums`` are under way (the device's part dispatched with the snapshot); the host sums
    its shards while they are written. Each item a checkpoint holds is one field here, written
    by `_write`.
    """

    final: pathlib.Path
    tree: dict[str, Any]
    checksums: Started
    describe: Callable[[Any], dict[str, Any]]  # checksums → the metadata
    keep_last: int | None
    step: int
    data: bytes | None  # this process's data-loader state, encoded when the save was called

    def run(self) -> pathlib.Path:
        """Writes the step directory and commits it (on every process); returns it."""
        key = f"torchshard-save-{self.step}"
        tmp = together(f"{key}-begin", lambda: _begin(self.final))
        record = together(f"{key}-data", lambda: write_data(tmp, self.data))
        # the same records on every process, so all raise or none; the next save removes tmp
        entry = data_entry(gathered(f"{key}-data-records", record))
        together(f"{key}-end", lambda: self._write_and_commit(tmp, entry))
        return self.final

    def _write_and_commit(self, tmp: pathlib.Path, data: dict[str, Any] | None) -> None:
        _write(tmp, self, data)
        if primary():
            _finish(tmp, self.final, self.keep_last, self.step)


def _write(tmp: pathlib.Path, save: _Save, data: dict[str, Any] | None) -> None:
    """Arrays (every process its shards), then the metadata (the commit marker, last); a failed write is undone.

    ``data`` is the metadata's entry for the data states every process wrote before (`write_data`).
    """
    try:
        # beside the writes (numpy and os.write both release the GIL), on a thread of its own: a background
        # save may still run at exit, when concurrent.futures pools take no more work
        sums = pending.on_thread(lambda: finish_checksums(save.checksums), name="torchshard-checksums")
        write_state(tmp / STATE, save.tree, key=f"torchshard-save-{next(_SAVES)}")
        meta = save.describe(sums.result())
        if primary():
            write_meta(tmp, meta | {"files": file_sizes(tmp / STATE), "data": data})
    except (OSError, ValueError) as e:
        if isinstance(e, ShardingError):
            raise
        if primary():
            with contextlib.suppress(OSError):  # best effort: the next save removes what is left
                discard(tmp)
        raise write_failure(save.final, e, cleanup="the partial save was removed; earlier steps are intact") from e


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


def _lock(target: Target) -> contextlib.AbstractContextManager[Any]:
    """A Trainer's step lock: no step donates its arrays while a snapshot is taken."""
    return target.lock if isinstance(target, Trainer) else contextlib.nullcontext()


def _snapshot(
    root: pathlib.Path, target: Target, step: int | None, keep_last: int | None, data: Any, *, copy: bool
) -> _Save:
    """Everything ``target`` and ``data`` save as they are now; ``copy`` takes device-side copies (the next step
    donates the state)."""
    step = (target.step_count if isinstance(target, Trainer) else 0) if step is None else step
    blob = snapshot_data(data)  # first: a state it cannot store is an error before anything else is done
    tree = state_tree(target, doing="save()")
    raise_if_any(unwritable(tree), header="save(): nothing was written", error=CheckpointError)
    if copy:  # on the devices: cheaper than a copy to the host, and the write reads host-visible shards anyway
        tree = jax.device_put(tree, jax.tree.map(lambda x: x.sharding, tree), may_alias=False)
    model = model_of(target)
    module, names = type(model).__name__, canonical_names(model)
    stacks = target.layout.stacks() if isinstance(target, Trainer) else {}

    def describe(sums: Any) -> dict[str, Any]:
        return metadata(module, names, tree, step, stacks=stacks, sums=sums)

    return _Save(root / step_name(step), tree, start_checksums(tree), describe, keep_last, step, blob)


@overload
def save(
    path: PathLike,
    target: Target,
    *,
    step: int | None = ...,
    keep_last: int | None = ...,
    background: Literal[False] = ...,
    data: Any = ...,
) -> pathlib.Path: ...


@overload
def save(
    path: PathLike,
    target: Target,
    *,
    step: int | None = ...,
    keep_last: int | None = ...,
    background: Literal[True],
    data: Any = ...,
) -> concurrent.futures.Future[pathlib.Path]: ...


def save(
    path: PathLike,
    target: Target,
    *,
    step: int | None = None,
    keep_last: int | None = None,
    background: bool = False,
    data: Any = None,
) -> pathlib.Path | concurrent.futures.Future[pathlib.Path]:
    """Saves a sharded checkpoint of a Trainer (or of a sharded module) to ``path/step_<N>``.

    A Trainer's checkpoint holds every parameter and buffer keyed by ``state_dict`` name (tied
    tensors once), the optimizer state, the step counter and the RNG base key; a module's holds
    its tensors. Each process writes its own shards into one file. The save is crash-safe: everything
    goes to a hidden temporary directory, ``torchshard.json`` (names, shapes, dtypes and a
    checksum of every array, the size of every file) is written last, and only then is the
    directory renamed to ``step_<N>``. Saving a step again renames the old copy aside and deletes
    it only after the new one is in place; ``keep_last`` deletes a step by renaming it out of
    sight first. A kill at any point leaves only complete steps listed (`checkpoint_steps`), and
    the next save puts the leftovers right (a complete old copy is renamed back, never lost).

    With ``background=True`` the state is copied on its devices (the Trainer's next step may
    run at once: the copy holds this step's values) and written by a background thread. One
    save runs at a time: a later save, `load`, `checkpoint_steps` and interpreter exit wait for
    it. If it fails, its Future raises the error, and so does the next save (once).

    With ``data=loader`` each process also saves ``loader.state_dict()`` (taken when `save` is
    called, a background save included) into the same step: `load` with ``data=`` gives each
    process its own state back, so a resumed run sees the batches an uninterrupted one would.
    Pass it on every process. The state is stored as pickle-free JSON (tensors, tuples, bytes
    and numpy arrays tagged and rebuilt exactly), so loading runs no code from the file.

    Layout::

        path/step_00000100/torchshard.json   metadata, the commit marker
        path/step_00000100/state/            process_<i>.bin (shards) + process_<i>.json (their index)
        path/step_00000100/data/process_0.json  with data=: each process's loader state

    Args:
        path: the checkpoint root directory (created if needed).
        target: a `Trainer`, or a module placed by `shard` / `init_sharded`.
        step: the number to save as (default: the Trainer's step count; 0 for a module).
            Saving a step that exists replaces it.
        keep_last: after saving, delete all but the newest ``keep_last`` steps (the one just
            saved is always kept); ``None`` keeps every step.
        background: return once the state is copied, and write it in the background.
        data: an object with ``state_dict()`` and ``load_state_dict()`` whose state is saved
            too: torchdata's ``StatefulDataLoader``, a sampler.

    Returns:
        The step directory written; with ``background=True`` a ``concurrent.futures.Future``
        of it.

    Raises:
        ArgumentError: bad arguments, ``data`` without ``state_dict``/``load_state_dict``, or a
            data state holding a value JSON cannot store (named, with its path in the state).
        ShardingError: a module whose tensors are not placed.
        CheckpointError: the disk is full, ``path`` is a file or not writable, or another OS
            error; the partial save is removed and earlier steps are intact. Also the error of
            a failed background save, raised by the save after it (before it does anything).

    Examples:
        >>> import tempfile, optax
        >>> root = tempfile.mkdtemp()
        >>> model = torch.nn.Linear(16, 4)
        >>> loss_fn = lambda m, b: m(b).square().mean()
        >>> trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})))
        >>> _ = trainer.step(torch.randn(8, 16))
        >>> save(root, trainer, keep_last=3).name
        'step_00000001'
        >>> pending = save(root, trainer, step=2, background=True)
        >>> _ = trainer.step(torch.randn(8, 16))  # trains while step 2 is written
        >>> pending.result().name
        'step_00000002'
    """
    root = _check_save_args(path, target, step, keep_last, background, data)
    pending.raise_failure()
    if not background:
        with _lock(target):
            return _snapshot(root, target, step, keep_last, data, copy=False).run()
    with _lock(target):
        job = _snapshot(root, target, step, keep_last, data, copy=True)
    return pending.submit(job.run)


def _check_load_args(path: Any, target: Any, step: Any, plan: Any, data: Any) -> None:
    problems = path_problems("path", path) + _target_problems(target) + data_problems(data)
    problems += int_problems("step", step, minimum=0, none="the latest")
    if plan is not None:
        problems += instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    if plan is not None and isinstance(target, Trainer):
        problems.append("plan= is for modules; a Trainer loads onto its own plan (build it with the plan you want)")
    raise_for_arguments(problems, header="invalid load() arguments")


def load(
    path: PathLike, target: Target, *, step: int | None = None, plan: ShardingPlan | None = None, data: Any = None
) -> Target:
    """Restores a checkpoint written by `save` into ``target``, resharding onto its plan.

    Each array is read directly into the target's sharding, so a checkpoint saved on
    one mesh or plan loads onto any other. A Trainer gets its parameters, buffers, optimizer
    state, step counter and RNG base key back, so training resumes exactly. A module gets its
    tensors (a Trainer's checkpoint loads into a bare module too). Names and shapes are checked
    like torch's strict ``load_state_dict``, and every array's checksum is verified. A
    background save still writing is waited for first. With ``data=loader`` (on every process)
    each process's loader gets the state it saved, checked against its checksum, before the
    target changes.

    Args:
        path: a checkpoint root (the latest complete step is loaded) or one ``step_<N>`` directory.
        target: a `Trainer`, or a module: sharded already (loaded onto its tensors' current
            shardings) or, with ``plan=``, on any device (``meta`` included).
        step: load this step of the root instead of the latest.
        plan: for a module, the `ShardingPlan` to load onto.
        data: the object (``StatefulDataLoader``, sampler) whose ``load_state_dict`` gets this
            process's data state saved by ``save(..., data=...)``.

    Returns:
        ``target``, now holding the checkpoint's values.

    Raises:
        ArgumentError: bad arguments.
        ShardingError: names or shapes do not match (every missing, unexpected and mis-shaped
            tensor listed), or the optimizer state does not.
        CheckpointError: no complete checkpoint at ``path``, or it is truncated or corrupted;
            with ``data=``: the step holds no data state, was saved by another number of
            processes, or ``data.load_state_dict`` rejects it.

    Examples:
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
        >>> class Position:  # any object with state_dict() and load_state_dict(), e.g. a StatefulDataLoader
        ...     def __init__(self, seen=0): self.seen = seen
        ...     def state_dict(self): return {"seen": self.seen}
        ...     def load_state_dict(self, state): self.seen = state["seen"]
        >>> _ = save(root, trainer, step=5, data=Position(seen=40))
        >>> load(root, resumed, data=(position := Position())).step_count, position.seen
        (1, 40)
    """
    _check_load_args(path, target, step, plan, data)
    pending.wait()
    step_dir = resolve(pathlib.Path(os.path.abspath(path)), step)
    meta = read_meta(step_dir)
    check_files(step_dir, recorded_sizes(meta))
    # every process reads its own file; all stop if any fails, before orbax's reads meet across processes
    data_state = together("torchshard-load-data", lambda: read_data(step_dir, meta) if data is not None else None)
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
    restored, sums = read_state(step_dir / STATE, item, step_dir=step_dir)
    raise_if_any(
        checksum_problems(meta, restored, sums),
        header=f"{step_dir} is corrupted; load an earlier step",
        error=CheckpointError,
    )
    arrays = destination_arrays(recipes_, restored["model"], dest)
    if data is not None:  # before the target changes: a loader that rejects its state leaves the target as it was
        restore_data(data, data_state, step_dir)
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
