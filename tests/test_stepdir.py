"""The step-directory protocol alone (fake data, no orbax): listing, recovery after crashes, and SIGKILL trials."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import random
import re
import signal
import time
import warnings

import pytest

import torchshard as ts
from torchshard._ckpt import pending
from torchshard._ckpt import stepdir as _stepdir
from torchshard._ckpt.stepdir import META, OLD, STATE, TMP, TRASH, begin, commit, discard, prune, recover, step_name

FILES = ("a", "d/b", "d/c")


def fake_step(directory: pathlib.Path, tag: str, *, damage: str = "") -> None:
    """A step directory whose every file holds ``tag``; ``damage`` breaks it as a crash or a disk would."""
    sizes = {}
    for name in FILES:
        file = directory / STATE / name
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(f"{tag}|{name}")
        sizes[name] = file.stat().st_size
    meta = json.dumps({"files": sizes})
    if damage == "no_meta":
        return
    if damage == "missing_file":
        (directory / STATE / "d/b").unlink()
    if damage == "truncated":
        (directory / STATE / "a").write_text("x")
    (directory / META).write_text({"garbled": meta[:9], "files_not_a_map": '{"files": [1]}'}.get(damage, meta))


def tag_of(directory: pathlib.Path) -> str:
    """The tag every file of a step holds (the test fails if they disagree: a mix of two saves)."""
    tags = {(directory / STATE / name).read_text().split("|")[0] for name in FILES}
    assert len(tags) == 1, (directory, tags)
    return tags.pop()


def layout(root: pathlib.Path) -> dict[str, str]:
    """Every entry of ``root`` → the tag of its files, or what is wrong with it."""
    return {d.name: (tag_of(d) if not _stepdir.incomplete(d) else "incomplete") for d in sorted(root.iterdir())}


def make(root: pathlib.Path, entries: dict[str, str]) -> None:
    for name, what in entries.items():
        tag, _, damage = what.partition(":")
        fake_step(root / name, tag, damage=damage)


S1, S2, S3 = step_name(1), step_name(2), step_name(3)
# name → "tag" (complete) or "tag:damage"; then the steps readers list (step → tag) and the layout after recovery
CRASHES = {
    "interrupted_save": ({S1: "A", TMP + S2: "B:no_meta"}, {1: "A"}, {S1: "A"}),
    "finished_but_uncommitted_save": ({S1: "A", TMP + S2: "B"}, {1: "A"}, {S1: "A"}),
    "resave_cut_between_renames": ({S1: "A", OLD + S2: "B", TMP + S2: "C"}, {1: "A", 2: "B"}, {S1: "A", S2: "B"}),
    "resave_cut_before_deleting_old": ({S2: "C", OLD + S2: "B"}, {2: "C"}, {S2: "C"}),
    "resave_cut_while_deleting_old": ({S2: "C", TRASH + OLD + S2: "B:missing_file"}, {2: "C"}, {S2: "C"}),
    "half_deleted_old_and_no_step": ({S1: "A", OLD + S2: "B:missing_file"}, {1: "A"}, {S1: "A"}),
    "prune_cut_after_its_rename": ({TRASH + S1: "A", S2: "B"}, {2: "B"}, {S2: "B"}),
    "prune_cut_mid_delete": ({TRASH + S1: "A:missing_file", S2: "B"}, {2: "B"}, {S2: "B"}),
    "damaged_step_with_a_complete_old_copy": ({S2: "C:truncated", OLD + S2: "B"}, {2: "B"}, {S2: "B"}),
    "damaged_step_is_left_alone": ({S1: "A", S3: "C:no_meta"}, {1: "A"}, {S1: "A", S3: "incomplete"}),
}


@pytest.mark.parametrize("crash", CRASHES)
def test_readers_list_only_complete_steps_and_recovery_keeps_them(tmp_path, crash):
    entries, listed, recovered = CRASHES[crash]
    make(tmp_path, entries)
    before = layout(tmp_path)
    steps = _stepdir.complete_steps(tmp_path)
    assert {s: tag_of(d) for s, d in steps.items()} == listed
    assert ts.checkpoint_steps(tmp_path) == sorted(listed)
    assert layout(tmp_path) == before  # readers change nothing: a save may be running elsewhere
    recover(tmp_path)
    assert layout(tmp_path) == recovered
    assert {s: tag_of(d) for s, d in _stepdir.complete_steps(tmp_path).items()} == listed


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("no_meta", r"no torchshard\.json \(an interrupted save, or not a checkpoint\)"),
        ("garbled", r"torchshard\.json is unreadable or malformed \(JSONDecodeError"),
        ("files_not_a_map", r"torchshard\.json is unreadable or malformed \(TypeError: its 'files' entry"),
        ("missing_file", r"state/d/b: missing"),
        ("truncated", r"state/a: 1 bytes, saved \d+"),
    ],
)
def test_incomplete_says_why(tmp_path, damage, why):
    fake_step(tmp_path / S1, "A", damage=damage)
    (problem,) = _stepdir.incomplete(tmp_path / S1)
    assert re.search(why, problem), problem


def test_resolve_skips_a_damaged_newer_step_and_says_so(tmp_path, caplog):
    make(tmp_path, {S1: "A", S2: "B:truncated"})
    with caplog.at_level(logging.WARNING, logger="torchshard._ckpt.stepdir"):
        assert _stepdir.resolve(tmp_path, None) == tmp_path / S1
    assert "loading step 1; newer step directories are incomplete" in caplog.text
    assert "step_00000002: state/a: 1 bytes, saved" in caplog.text


@pytest.mark.parametrize(
    ("entries", "step", "match"),
    [
        ({S1: "A", S2: "B:truncated"}, 2, r"no complete checkpoint for step 2 under .* \(state/a: 1 bytes, saved"),
        ({S1: "A"}, 5, r"no complete checkpoint for step 5 under .* \(no such step\); available steps: \[1\]"),
        (
            {S2: "B:garbled", S3: "C:no_meta"},
            None,
            r"(?s)no complete checkpoint at .*; pass the checkpoint root .* \(2 problems\).*"
            r"step_00000002: torchshard\.json is unreadable.*step_00000003: no torchshard\.json",
        ),
    ],
    ids=["damaged_step", "missing_step", "nothing_complete"],
)
def test_resolve_errors_name_the_step_and_why(tmp_path, entries, step, match):
    make(tmp_path, entries)
    with pytest.raises(ts.CheckpointError, match=match):
        _stepdir.resolve(tmp_path, step)


def test_resolve_finds_a_step_directory_cut_between_its_renames(tmp_path):
    make(tmp_path, {OLD + S2: "B"})
    assert _stepdir.resolve(tmp_path / S2, None) == tmp_path / (OLD + S2)


@pytest.mark.parametrize("path", [None, 3, "", b"ckpt", ["ckpt"]])
def test_checkpoint_steps_rejects_what_is_not_a_path(path):
    with pytest.raises(ts.ArgumentError, match=r"(?s)checkpoint_steps\(\) arguments .*must be a directory path"):
        ts.checkpoint_steps(path)


def test_checkpoint_steps_of_an_unreadable_root_is_a_checkpoint_error(tmp_path, monkeypatch):
    tmp_path.joinpath(S1).mkdir()

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pathlib.Path, "iterdir", denied)
    with pytest.raises(ts.CheckpointError, match=r"cannot be read \(Permission denied\); check its permissions"):
        ts.checkpoint_steps(tmp_path)


# --- real SIGKILLs of a process running the protocol ---------------------------------------------

KEEP = 2


def save_fake(root: pathlib.Path, step: int, tag: str) -> None:
    """One save through the protocol, as `torchshard.save` drives it, with fake data."""
    final = root / step_name(step)
    tmp = begin(final)
    fake_step(tmp, tag)
    discard(commit(tmp, final))
    prune(root, KEEP, saved=step)


def writer(root: pathlib.Path, first: int, background: bool = False) -> None:
    """Saves every step twice (the re-save path) with keep_last=2 until killed (on the save thread: ``background``)."""
    if background:
        pending._pending = pending._Pending()  # this forked child's own: the parent's save thread did not survive fork
    version = first
    for step in range(first, first + 10**6):
        for _ in range(2):
            version += 1
            if background:
                pending.submit(lambda s=step, tag=f"{step}.{version}": save_fake(root, s, tag)).result()
            else:
                save_fake(root, step, f"{step}.{version}")


def check_after_kill(root: pathlib.Path, last_newest: int) -> int:
    steps = {s: tag_of(d) for s, d in _stepdir.complete_steps(root).items()}  # each a whole save, not a mix
    assert all(tag.split(".")[0] == str(s) for s, tag in steps.items()), steps
    # no bound on how many: writers killed between a commit and its prune each leave one more
    # complete step, which the next save that completes prunes (checked at the end)
    assert not steps or max(steps) >= last_newest, (steps, last_newest)  # the newest complete step is never lost
    return max(steps, default=last_newest)


def seconds_per_save(root: pathlib.Path) -> float:
    """The median time of one save here, now: kill delays scale with it, so a loaded machine tests as much."""
    times = []
    for step in range(1, 8):
        start = time.perf_counter()
        save_fake(root, step, f"{step}.0")
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_sigkill_at_random_points_of_save_resave_and_prune(tmp_path, background):
    rng = random.Random(0)
    # fixed delays (2-40 ms) once let a loaded CI machine kill every writer before its first commit,
    # so the delays are drawn from 0-4 saves as timed here, and counted from when the child is running
    per_save = seconds_per_save(tmp_path / "calibration")
    root = tmp_path / "run"
    newest, first = 0, 1
    for _ in range(30):
        ready_r, ready_w = os.pipe()
        with warnings.catch_warnings():  # JAX warns of forks; the child never touches JAX
            warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
            pid = os.fork()
        if pid == 0:  # the child only runs pure-Python file operations, then dies by SIGKILL
            try:
                os.write(ready_w, b"1")
                writer(root, first, background)
            finally:
                os._exit(1)
        os.read(ready_r, 1)  # a fork of a large process can take longer than a save: start the clock here
        os.close(ready_r)
        os.close(ready_w)
        time.sleep(rng.uniform(0.0, 4 * per_save))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        newest = check_after_kill(root, newest)
        first = newest + 10  # the next writer saves newer steps over whatever this kill left
    assert newest > 1, "the writer never committed: the kills came too early to test anything"
    save_fake(root, 10**7, "final")
    assert sorted(p.name for p in root.iterdir()) == [step_name(newest), step_name(10**7)]
