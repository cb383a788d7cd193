"""Fault injection: a save or export killed, interrupted or out of disk at each step loses nothing."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
import safetensors.torch
from torch import nn

import torchshard as ts
from testsupport.checkpoint_runs import TP_LM, Cursor, data_files, read_safetensors, sharded, values
from testsupport.models import MLP, TiedLM
from torchshard._ckpt import checkpoint as _checkpoint
from torchshard._ckpt import datastate as _datastate
from torchshard._ckpt import meta as _ckpt_meta
from torchshard._ckpt import shards as _shards
from torchshard._ckpt import stepdir as _stepdir


class Interrupted(KeyboardInterrupt):
    pass


def _raise(*_: Any, **__: Any) -> None:
    raise Interrupted


def after(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run_then_raise(*args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)
        raise Interrupted

    return run_then_raise


INTERRUPTIONS = {  # where a save dies: (object, attribute, replacement)
    "inside_the_shard_write": (_shards, "_write_all", _raise),
    "after_arrays": (_checkpoint, "write_state", after(_checkpoint.write_state)),
    "after_metadata": (_checkpoint, "write_meta", after(_checkpoint.write_meta)),
    "at_rename": (_checkpoint, "commit", _raise),
}


@pytest.mark.parametrize("where", INTERRUPTIONS)
def test_an_interrupted_save_never_loads_and_is_cleaned_up(tmp_path, mesh_dm, monkeypatch, where):
    model = sharded(MLP, mesh_dm)
    ts.save(tmp_path, model, step=4)
    before = values(model)
    with monkeypatch.context() as m:
        m.setattr(*INTERRUPTIONS[where])
        with pytest.raises(Interrupted):
            ts.save(tmp_path, sharded(MLP, mesh_dm, seed=2), step=8)
    assert ts.checkpoint_steps(tmp_path) == [4]
    target = sharded(MLP, mesh_dm, seed=3)
    jax.tree.map(np.testing.assert_array_equal, values(ts.load(tmp_path, target)), before)
    with pytest.raises(ts.CheckpointError, match=r"no complete checkpoint for step 8 .* available steps: \[4\]"):
        ts.load(tmp_path, target, step=8)
    ts.save(tmp_path, model, step=9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000009"]


# --- crash consistency: a kill at every filesystem step of save, re-save, prune and recovery ----------


class Killed(BaseException):
    """A simulated SIGKILL: no handler catches it and nothing after it runs."""


class Faults:
    """Counts every filesystem step a save takes (renames, deletions, writes) and kills it at step ``at``."""

    def __init__(self, at: int) -> None:
        self.at, self.steps = at, []

    def step(self, what: str) -> None:
        self.steps.append(what)
        if len(self.steps) == self.at:
            raise Killed(what)

    def counting(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            path = next((a for a in args if isinstance(a, str | os.PathLike)), "")
            self.step(f"{name} {pathlib.Path(path).name}")
            return fn(*args, **kwargs)

        return run

    def rmtree(self, path: Any) -> None:
        """Deletes like shutil.rmtree, killable before it starts and after its first file (half-deleted)."""
        self.step(f"rmtree {pathlib.Path(path).name}")
        first = next((f for f in sorted(pathlib.Path(path).rglob("*")) if f.is_file()), None)
        if first is not None:
            first.unlink()
            self.step(f"rmtree {pathlib.Path(path).name} (one file deleted)")
        shutil.rmtree(path)

    def write_meta(self, directory: pathlib.Path, meta: dict[str, Any]) -> None:
        """Killable before the commit marker is written and after half of it (a torn write)."""
        self.step("write torchshard.json")
        (directory / "torchshard.json").write_text(json.dumps(meta)[:50])
        self.step("write torchshard.json (torn)")
        _ckpt_meta.write_meta(directory, meta)

    def write_data(self, tmp: pathlib.Path, blob: bytes | None) -> str:
        """Killable before this process's data state is written and after half of it."""
        self.step("write data/process_0.json")
        (tmp / "data").mkdir(exist_ok=True)
        (tmp / _datastate.data_file(0)).write_bytes((blob or b"")[: len(blob or b"") // 2])
        self.step("write data/process_0.json (torn)")
        return _datastate.write_data(tmp, blob)


class _Namespace:
    """A module whose named functions are replaced; everything else is the real module's."""

    def __init__(self, real: Any, **replaced: Callable[..., Any]) -> None:
        self.__dict__.update(replaced, _real=real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def inject(monkeypatch, faults: Faults) -> None:
    fake_os = _Namespace(
        os, **{n: faults.counting(n, getattr(os, n)) for n in ("replace", "unlink", "mkdir", "makedirs")}
    )
    monkeypatch.setattr(_stepdir, "os", fake_os)
    monkeypatch.setattr(_stepdir, "shutil", _Namespace(shutil, rmtree=faults.rmtree))
    monkeypatch.setattr(_checkpoint, "write_state", faults.counting("write_state", _checkpoint.write_state))
    monkeypatch.setattr(_checkpoint, "write_meta", faults.write_meta)
    monkeypatch.setattr(_checkpoint, "write_data", faults.write_data)


TINY = lambda: nn.Linear(4, 2)  # noqa: E731  # few files: every step of the protocol stays cheap to kill at
OLD, TMP, TRASH = _stepdir.OLD, _stepdir.TMP, _stepdir.TRASH


@dataclasses.dataclass(frozen=True)
class Scenario:
    before: dict[str, int]  # entry name → which template model's complete step it copies (-1: with a file missing)
    save: tuple[int, int | None]  # the step saved (by model "new") and keep_last
    must_list: dict[int, set[str]]  # steps that are always listed → the models they may hold
    may_list: dict[int, set[str]]  # steps that may be listed → the models they may hold
    final: list[int]  # the listing when the save is not killed


N = {s: _stepdir.step_name(s) for s in range(5)}
SCENARIOS = {
    "save": Scenario({N[1]: 1, N[2]: 2}, (3, None), {1: {"1"}, 2: {"2"}}, {3: {"new"}}, [1, 2, 3]),
    "resave": Scenario({N[1]: 1, N[2]: 2}, (2, None), {1: {"1"}, 2: {"2", "new"}}, {}, [1, 2]),
    "prune": Scenario({N[1]: 1, N[2]: 2, N[3]: 3}, (4, 2), {3: {"3"}}, {1: {"1"}, 2: {"2"}, 4: {"new"}}, [3, 4]),
    "resave_and_prune": Scenario({N[1]: 1, N[2]: 2, N[3]: 3}, (3, 2), {3: {"3", "new"}}, {1: {"1"}, 2: {"2"}}, [2, 3]),
    "recovery_of_a_crash": Scenario(
        {N[1]: 1, OLD + N[2]: 2, TMP + N[3]: -1, TRASH + N[0]: -1},
        (4, 2),
        {2: {"2"}},
        {1: {"1"}, 4: {"new"}},
        [2, 4],
    ),
}


SEEDS = {"1": 1, "2": 2, "3": 3, "new": 7, "next": 8}


def cursor(name: str) -> Cursor:
    """The data state saved with model ``name``: a sampler whose generator and position are its own."""
    return Cursor(seed=SEEDS[name], seen=10 * SEEDS[name])


@pytest.fixture(scope="module")
def templates(tmp_path_factory, mesh_dm_module):
    """Complete step directories of tiny models "1", "2", "3" (copied, never saved again) and the models.

    Every step holds its model's data state too: a listed step must hold both of one save.
    """
    root = tmp_path_factory.mktemp("templates")
    models = {name: sharded(TINY, mesh_dm_module, seed=seed) for name, seed in SEEDS.items()}
    for i in (1, 2, 3):
        ts.save(root, models[str(i)], step=i, data=cursor(str(i)))
    return root, models


@pytest.fixture(scope="module")
def mesh_dm_module():
    return ts.make_mesh({"data": 4, "model": 2})


def _copy_before(root: pathlib.Path, templates: pathlib.Path, before: dict[str, int]) -> None:
    for name, model in before.items():
        shutil.copytree(templates / _stepdir.step_name(abs(model)), root / name)
        if model < 0:
            data_files(root / name)[0].unlink()


def _held_model(root: pathlib.Path, step: int, models: dict[str, nn.Module], probe: nn.Module) -> str:
    """Which model a listed step holds (it must load, and hold one of them and its data state exactly)."""
    loaded = Cursor(seed=0)
    got = values(ts.load(root, probe, step=step, data=loaded))
    same = [k for k, m in models.items() if all(np.array_equal(got[n], v) for n, v in values(m).items())]
    assert len(same) == 1, (step, same)
    assert (loaded.seen, loaded.next()) == (cursor(same[0]).seen, cursor(same[0]).next()), (step, same)
    return same[0]


def _check_listing(root: pathlib.Path, scenario: Scenario, models, probe, where: str) -> list[int]:
    listed = ts.checkpoint_steps(root)
    for step in scenario.must_list:
        assert step in listed, f"killed at {where}: step {step} vanished ({listed})"
    for step in listed:
        allowed = scenario.must_list.get(step) or scenario.may_list.get(step)
        assert allowed is not None, f"killed at {where}: step {step} listed ({listed})"
        assert _held_model(root, step, models, probe) in allowed, (where, step)
    return listed


def _killable_save(root: pathlib.Path, model: nn.Module, step: int, keep_last: int | None, background: bool) -> None:
    if not background:
        ts.save(root, model, step=step, keep_last=keep_last, data=cursor("new"))
        return
    future = ts.save(root, model, step=step, keep_last=keep_last, background=True, data=cursor("new"))
    try:
        future.result()  # the kill hits the save thread; its Future carries it
    except Killed:
        with pytest.raises(Killed):  # and the next save raises it once more, before it touches anything
            ts.save(root, model, step=step)
        raise


@pytest.mark.parametrize("background", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "background"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_a_kill_at_any_filesystem_step_leaves_only_complete_listed_steps(
    tmp_path, monkeypatch, templates, mesh_dm_module, name, background
):
    """Kills the save at its 1st, 2nd, ... filesystem step until one runs through; checks every outcome."""
    template_root, models = templates
    scenario, probe = SCENARIOS[name], sharded(TINY, mesh_dm_module, seed=9)
    step, keep_last = scenario.save
    for at in range(1, 100):
        root = tmp_path / f"kill_at_{at}"
        _copy_before(root, template_root, scenario.before)
        faults = Faults(at)
        with monkeypatch.context() as m:
            inject(m, faults)
            with contextlib.suppress(Killed):
                _killable_save(root, models["new"], step, keep_last, background)
        where = faults.steps[-1] if len(faults.steps) >= at else "nowhere (not killed)"
        listed = _check_listing(root, scenario, models, probe, where)
        ts.save(root, models["next"], step=9, data=cursor("next"))  # the next save recovers and works
        assert ts.checkpoint_steps(root) == sorted({*listed, 9}), where
        assert all(p.name.startswith("step_") for p in root.iterdir()), (where, sorted(root.iterdir()))
        assert _held_model(root, 9, models, probe) == "next"
        if len(faults.steps) < at:  # ran through: every step before was a kill point
            assert listed == scenario.final
            break
    else:
        raise AssertionError(f"the save was still being killed after 99 steps: {faults.steps}")
    assert at > 5, faults.steps  # a save takes several steps: each was killed once


# --- full disks, read-only mounts, files in the way ----------------------------------------------


def enospc(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def full_mid_file(fd: int, _: Any) -> None:
    os.write(fd, b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")


def read_only(*_: Any, **__: Any) -> None:
    raise OSError(errno.EROFS, "Read-only file system")


OS_FAULTS = {  # (object, attribute, replacement, message)
    "disk_full": (_checkpoint, "write_state", enospc, r"the disk is full \(No space left on device\)"),
    "disk_full_mid_file": (_shards, "_write_all", full_mid_file, r"the disk is full \(No space left on device\)"),
    "disk_full_writing_metadata": (_checkpoint, "write_meta", enospc, r"the disk is full"),
    "read_only_mount": (_stepdir.os, "mkdir", read_only, r": not writable \(Read-only file system\)"),
}


@pytest.mark.parametrize("fault", OS_FAULTS)
def test_os_errors_during_save_are_checkpoint_errors_and_leave_earlier_steps(tmp_path, mesh_dm, monkeypatch, fault):
    model = sharded(MLP, mesh_dm)
    ts.save(tmp_path, model, step=1)
    obj, attribute, replacement, match = OS_FAULTS[fault]
    with monkeypatch.context() as m:
        m.setattr(obj, attribute, replacement)
        with pytest.raises(ts.CheckpointError, match=match) as info:
            ts.save(tmp_path, sharded(MLP, mesh_dm, seed=1), step=2)
    assert str(tmp_path) in str(info.value)
    assert str(info.value).endswith(("then save again", "(not a read-only mount)"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # the partial save is gone
    jax.tree.map(np.testing.assert_array_equal, values(ts.load(tmp_path, sharded(MLP, mesh_dm, seed=2))), values(model))


# --- atomic safetensors exports ------------------------------------------------------------------


def export_state(directory: pathlib.Path) -> dict[str, np.ndarray] | None:
    """The tensors of a complete export in ``directory`` (None if there is none)."""
    if not (directory / "model.safetensors.index.json").exists():
        return None
    _, tensors = read_safetensors(directory)
    return {k: v.numpy() for k, v in tensors.items()}


def same(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray]) -> bool:
    return a is not None and a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in b)


def inject_export(monkeypatch, faults: Faults) -> None:
    inject(monkeypatch, faults)
    from torchshard._interop import safetensors as _safetensors

    counted = {name: faults.counting(name, getattr(os, name)) for name in ("mkdir", "makedirs", "link")}
    monkeypatch.setattr(_safetensors, "os", _Namespace(os, **counted))
    monkeypatch.setattr(safetensors.torch, "save_file", faults.counting("save_file", safetensors.torch.save_file))
    monkeypatch.setattr(pathlib.Path, "write_text", faults.counting("write_text", pathlib.Path.write_text))


def test_a_kill_at_any_step_of_an_export_keeps_a_complete_export(tmp_path, mesh_dm, monkeypatch):
    out, template = tmp_path / "export", tmp_path / "template"
    old_model, new_model = sharded(TiedLM, mesh_dm, TP_LM), sharded(TiedLM, mesh_dm, TP_LM, seed=1)
    ts.save_safetensors(template, new_model, max_shard_bytes=9000)
    new = export_state(template)
    ts.save_safetensors(template, old_model, max_shard_bytes=9000)
    (template / "config.json").write_text("{}")
    old = export_state(template)
    for at in range(1, 100):
        shutil.copytree(template, out)
        faults = Faults(at)
        with monkeypatch.context() as m:
            inject_export(m, faults)
            with contextlib.suppress(Killed):
                ts.save_safetensors(out, new_model, max_shard_bytes=9000)
        where = faults.steps[-1] if len(faults.steps) >= at else "nowhere"
        # a complete old or new export; killed between the two renames, the old one waits hidden beside it
        found = export_state(out if out.exists() else tmp_path / (OLD + "export"))
        assert same(found, old) or same(found, new), where
        ts.save_safetensors(out, old_model, max_shard_bytes=9000)  # recovers what the kill left, and works
        assert same(export_state(out), old) and (out / "config.json").read_text() == "{}", where
        assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "template"], where
        shutil.rmtree(out)
        if len(faults.steps) < at:
            break
    assert at > 8, faults.steps


def test_a_full_disk_during_an_export_keeps_the_previous_export(tmp_path, mesh_dm, monkeypatch):
    model = sharded(TiedLM, mesh_dm, TP_LM)
    ts.save_safetensors(tmp_path / "export", model, max_shard_bytes=9000)
    before = export_state(tmp_path / "export")
    fail = safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(fail))
    with pytest.raises(ts.CheckpointError, match=r"export: the disk is full .*; the previous export is intact\. Free"):
        ts.save_safetensors(tmp_path / "export", sharded(TiedLM, mesh_dm, TP_LM, seed=1))
    assert same(export_state(tmp_path / "export"), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_export_onto_a_file_is_a_checkpoint_error(tmp_path, mesh_dm):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ts.CheckpointError, match=r"afile: a file is in the way .*pass a directory path"):
        ts.save_safetensors(tmp_path / "afile", sharded(MLP, mesh_dm))


def test_an_export_into_the_working_directory_keeps_it_usable(tmp_path, mesh_dm, monkeypatch):
    (tmp_path / "export").mkdir()
    monkeypatch.chdir(tmp_path / "export")
    ts.save_safetensors(".", sharded(MLP, mesh_dm))
    ts.save_safetensors(".", sharded(MLP, mesh_dm, seed=1))  # replaces the directory the process is in
    assert pathlib.Path.cwd() == tmp_path / "export"
    assert pathlib.Path("model.safetensors.index.json").exists()
