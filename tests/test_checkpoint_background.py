"""Background saves: the step's values while training goes on, waiting, errors that surface twice, bad calls."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
import pytest
import torch

import torchshard as ts
from testsupport.checkpoint_runs import RUNS, host_tree, make_trainer, sharded, values
from testsupport.models import MLP
from torchshard._ckpt import checkpoint as _checkpoint
from torchshard._ckpt import pending


@pytest.mark.slow
def test_a_background_save_holds_its_steps_values_while_training_continues(tmp_path, mesh_dm):
    """The Trainer donates its state every step: the save must have copied it, or it would read deleted arrays."""
    run = RUNS["tiedlm_adamw"]
    trainer = make_trainer(run, mesh_dm, run.rules, torch_seed=0, seed=0)
    batches = run.batches(8)
    for b in batches[:4]:
        trainer.step(b)
    future = ts.save(tmp_path, trainer, background=True)
    assert isinstance(future, concurrent.futures.Future)
    state = host_tree(trainer.state)
    later = [float(trainer.step(b)["loss"]) for b in batches[4:]]  # donates the arrays the save was given
    assert future.result() == tmp_path / "step_00000004"
    resumed = make_trainer(run, mesh_dm, run.rules, torch_seed=1, seed=1)
    ts.load(tmp_path, resumed)
    jax.tree.map(np.testing.assert_array_equal, host_tree(resumed.state), state)
    np.testing.assert_allclose([float(resumed.step(b)["loss"]) for b in batches[4:]], later, rtol=1e-5)


class SlowWrites:
    """Makes every array write wait until released, so a test sees a background save in flight."""

    def __init__(self, monkeypatch) -> None:
        self.release, self.started = threading.Event(), threading.Event()
        real = _checkpoint.write_state

        def slow(*args: Any, **kwargs: Any) -> None:
            self.started.set()
            assert self.release.wait(30)
            real(*args, **kwargs)

        monkeypatch.setattr(_checkpoint, "write_state", slow)

    def release_soon(self) -> None:
        assert self.started.wait(30)
        threading.Timer(0.3, self.release.set).start()


WAITERS = {
    "checkpoint_steps": lambda root, probe: ts.checkpoint_steps(root) == [1],
    "load": lambda root, probe: ts.load(root, probe) is probe,
    "save": lambda root, probe: ts.save(root, probe, step=2) == root / "step_00000002",
}


@pytest.mark.parametrize("waiter", WAITERS)
def test_listing_loading_and_saving_wait_for_the_pending_save(tmp_path, mesh_dm, monkeypatch, waiter):
    model, probe = sharded(MLP, mesh_dm), sharded(MLP, mesh_dm, seed=1)
    slow = SlowWrites(monkeypatch)
    future = ts.save(tmp_path, model, step=1, background=True)
    slow.release_soon()
    assert not future.done()
    assert WAITERS[waiter](tmp_path, probe)
    assert future.done() and future.result() == tmp_path / "step_00000001"
    assert ts.checkpoint_steps(tmp_path)[0] == 1


def test_a_background_save_returns_before_its_arrays_are_written(tmp_path, mesh_dm, monkeypatch):
    model = sharded(MLP, mesh_dm)
    slow = SlowWrites(monkeypatch)
    start = time.monotonic()
    future = ts.save(tmp_path, model, step=1, background=True)
    assert time.monotonic() - start < 10 and not future.done()
    slow.release.set()
    assert future.result() == tmp_path / "step_00000001"


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # Linux: per thread, by its native id


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities are a Linux/Unix feature")
def test_a_background_save_writes_at_a_lower_cpu_priority_than_the_training_thread(tmp_path, mesh_dm, monkeypatch):
    """Where the host's cores also run the step (CPU devices), the write must yield to it: 0.9-1.1 step times of
    stall per save at niceness 0 against 0.3-0.4 at +10, measured at load average 5 (2 cores).

    The mechanism, read from the kernel: the save thread, started here, runs at this thread's niceness + 10
    (19 at most), and so does a thread it starts. A save thread of its own (not one an earlier test started,
    from whichever thread, at whatever niceness then), and only this save's writes counted (not an earlier
    background save still writing on a loaded machine), so the result does not depend on what ran before.
    """
    pending.wait()
    fresh = pending._Pending()
    monkeypatch.setattr(pending, "_pending", fresh)
    training = _niceness()
    if training >= 19:
        pytest.skip(f"this thread already runs at niceness {training}: no lower priority exists")
    seen: list[tuple[str, int, int]] = []
    real = _checkpoint.write_state

    def noting(directory: Any, *args: Any, **kwargs: Any) -> None:
        if tmp_path in directory.parents:
            started: list[int] = []
            child = threading.Thread(target=lambda: started.append(_niceness()))
            child.start()
            child.join()
            seen.append((threading.current_thread().name.split("_")[0], _niceness(), *started))
        real(directory, *args, **kwargs)

    monkeypatch.setattr(_checkpoint, "write_state", noting)
    try:
        ts.save(tmp_path, sharded(MLP, mesh_dm), step=1, background=True).result()
    finally:
        pending.wait()  # the fresh save's thread, before the real _pending returns
    lower = min(training + 10, 19)
    assert seen == [("torchshard-save", lower, lower)] and lower > training


def full_disk(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_background_save_raises_from_its_future_and_again_from_the_next_save(tmp_path, mesh_dm, monkeypatch):
    model = sharded(MLP, mesh_dm)
    ts.save(tmp_path, model, step=1)
    with monkeypatch.context() as m:
        m.setattr(_checkpoint, "write_state", full_disk)
        future = ts.save(tmp_path, sharded(MLP, mesh_dm, seed=1), step=2, background=True)
        with pytest.raises(ts.CheckpointError, match=r"step_00000002: the disk is full") as first:
            future.result()
    with pytest.raises(ts.CheckpointError, match=r"step_00000002: the disk is full") as again:
        ts.save(tmp_path, model, step=3)  # raises before it does anything
    assert again.value is first.value
    assert ts.checkpoint_steps(tmp_path) == [1]
    assert ts.save(tmp_path, model, step=3, background=True).result() == tmp_path / "step_00000003"  # raised once
    assert ts.checkpoint_steps(tmp_path) == [1, 3]
    jax.tree.map(np.testing.assert_array_equal, values(ts.load(tmp_path, sharded(MLP, mesh_dm, seed=2))), values(model))


@pytest.mark.parametrize("background", ["yes", 1, None])
def test_background_must_be_a_bool(tmp_path, mesh_dm, background):
    model = sharded(MLP, mesh_dm)
    with pytest.raises(ts.ArgumentError, match=rf"background={background!r} must be True or False"):
        ts.save(tmp_path, model, background=background)
    assert not tmp_path.joinpath("step_00000000").exists()


EXITING = """
import sys, threading, time
import jax, torch
import torchshard as ts
from torchshard._ckpt import checkpoint

real = checkpoint.write_state


def slow(*args, **kwargs):  # the save writes only once this process's main thread has ended
    while threading.main_thread().is_alive():
        time.sleep(0.05)
    print("writing after the main thread ended", flush=True)
    real(*args, **kwargs)


checkpoint.write_state = slow
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
mesh = ts.make_mesh({"data": jax.device_count()})
ts.save(sys.argv[1], ts.shard(model, ts.plan(model, mesh)), step=7, background=True)
"""


def two_linears() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


@pytest.mark.slow
def test_a_process_that_exits_right_after_a_background_save_leaves_it_complete(tmp_path, mesh_dm):
    done = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "writing after the main thread ended" in done.stdout
    assert ts.checkpoint_steps(tmp_path) == [7]
    probe = ts.load(tmp_path, sharded(two_linears, mesh_dm, seed=1))
    torch.manual_seed(0)
    jax.tree.map(np.testing.assert_array_equal, values(probe), values(two_linears()))


def test_a_save_helper_runs_in_place_where_the_interpreter_refuses_new_threads_at_exit(monkeypatch):
    """CPython 3.12.0 and 3.12.1 refuse a thread started while the interpreter waits for its non-daemon threads at
    exit (python/cpython#113964): a background save still running then started its helpers, and failed."""

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    ran_on: list[threading.Thread] = []
    future = pending.on_thread(lambda: ran_on.append(threading.current_thread()) or 42, name="helper")
    assert future.result(timeout=0) == 42
    assert ran_on == [threading.current_thread()]
    failing = pending.on_thread(lambda: 1 / 0, name="helper")
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=0)
