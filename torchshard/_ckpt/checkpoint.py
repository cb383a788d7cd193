"""save: atomic sharded checkpoints of a Trainer or module, which `load` reshards onto any plan."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import pathlib
from collections.abc import Callable
from typing import Any, Literal, overload

import jax

from torchshard._base.errors import CheckpointError, ShardingError, raise_if_any
from torchshard._base.validate import int_problems, raise_for_arguments
from torchshard._bridge.module_tensors import canonical_names
from torchshard._ckpt import pending
from torchshard._ckpt.checksum import Started, finish_checksums, start_checksums
from torchshard._ckpt.datastate import data_entry, data_problems, snapshot_data, write_data
from torchshard._ckpt.meta import metadata, write_meta
from torchshard._ckpt.processes import primary, together
from torchshard._ckpt.shards import unwritable, write_state
from torchshard._ckpt.state import Target, model_of, state_tree, target_problems
from torchshard._ckpt.stepdir import (
    STATE,
    TMP,
    PathLike,
    begin,
    commit,
    discard,
    file_sizes,
    path_problems,
    prune,
    step_name,
    write_failure,
)
from torchshard._multihost.agree import gathered
from torchshard._trainer.trainer import Trainer

_SAVES = itertools.count()  # every process saves in the same order: the n-th save's barriers are unique and agree


def _check_save_args(path: Any, target: Any, step: Any, keep_last: Any, background: Any, data: Any) -> pathlib.Path:
    problems = target_problems(target) + int_problems("step", step, minimum=0, none="the Trainer's step count")
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
