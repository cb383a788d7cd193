"""ts.track: the rows a Trainer logs, read back through each library's own files and readers."""

from __future__ import annotations

import json
import struct
import sys
import time
import types

import jax
import optax
import pytest
import torch
from models import MLP

import torchshard as ts
from torchshard._base.errors import ArgumentError

# what a Trainer hands its trackers (see the first test): rows every log_every steps, and an evaluation
ROWS = [(2, {"loss": 0.9709, "grad_norm": 0.4622, "step_time_s": 0.0122, "memory_peak_bytes": 9216.0}),
        (4, {"loss": 0.9314, "grad_norm": 0.4410, "step_time_s": 0.0101, "memory_peak_bytes": 9216.0}),
        (4, {"eval/loss": 0.9141})]  # fmt: skip


class Recorder:
    def __init__(self):
        self.rows, self.closed = [], 0

    def log(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


def replay(tracker, rows):
    for step, metrics in rows:
        tracker.log(step, metrics)
    tracker.close()


@pytest.mark.slow
def test_the_trainer_logs_every_nth_step_and_evaluations_to_its_trackers():
    recorder = Recorder()
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    trainer = ts.Trainer(model, loss, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})),
                         log_every=2, trackers=[recorder])  # fmt: skip
    batch = (torch.randn(16, 8), torch.randn(16, 4))
    losses = [float(trainer.step(batch)["loss"]) for _ in range(4)]
    evaluated = trainer.log(trainer.evaluate(batch), prefix="eval/")
    trainer.close()
    assert [step for step, _ in recorder.rows] == [2, 4, 4] and recorder.closed == 1
    assert [m["loss"] for _, m in recorder.rows[:2]] == [losses[1], losses[3]]
    assert recorder.rows[-1][1] == evaluated == {"eval/loss": float(trainer.evaluate(batch)["loss"])}


def test_jsonl_rows(tmp_path):
    rows = ROWS
    replay(ts.track.JSONL(tmp_path / "run" / "metrics.jsonl"), rows)
    read = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert read == [{"step": step, **metrics} for step, metrics in rows]


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = ROWS
    replay(ts.track.TensorBoard(tmp_path / "tb"), rows)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {name for _, metrics in rows for name in metrics}
    assert [e.step for e in events.Scalars("loss")] == [2, 4]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([m["loss"] for _, m in rows[:2]])  # float32
    assert [e.step for e in events.Scalars("eval/loss")] == [4]


def wandb_history(run_file):
    """The history rows of an offline W&B run: its .wandb file is a LevelDB-style log of protobuf records."""
    from wandb.proto import wandb_internal_pb2

    data, position, chunk, rows = run_file.read_bytes(), 7, b"", []  # 7: the ":W&B" header, magic and version
    while position + 7 <= len(data):
        if (room := 32768 - position % 32768) < 7:  # 32 KiB blocks; a record header never straddles one
            position += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            break
        chunk, position = chunk + data[position + 7 : position + 7 + length], position + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record.FromString(chunk)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})  # fmt: skip
            chunk = b""
    return rows


@pytest.mark.slow
def test_wandb_offline_run_directory_holds_the_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = ROWS
    replay(ts.track.WandB(project="torchshard-test", dir=str(tmp_path)), rows)
    [run_file] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's own service process writes the file and may still be flushing after finish() returns: on a loaded
    # machine the suite once read it with no history yet; wait for the last row (eval/loss), up to a minute
    deadline, history = time.monotonic() + 60, wandb_history(run_file)
    while not any("eval/loss" in h for h in history) and time.monotonic() < deadline:
        time.sleep(0.5)
        history = wandb_history(run_file)
    assert [(h["_step"], h["loss"]) for h in history if "loss" in h] == [(s, m["loss"]) for s, m in rows[:2]]
    assert [h["eval/loss"] for h in history if "eval/loss" in h] == [rows[-1][1]["eval/loss"]]


def test_trackio_is_called_as_its_api_says(monkeypatch):
    # trackio's dependencies pin pillow<13 (constraints.txt has 13): checked against a stand-in for its API
    calls = []
    fake = types.ModuleType("trackio")
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda metrics, step=None: calls.append(("log", step, metrics))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "trackio", fake)
    rows = ROWS
    replay(ts.track.Trackio(project="p"), rows)
    assert calls == [("init", {"project": "p"}), *[("log", s, m) for s, m in rows], ("finish",)]


@pytest.mark.parametrize(
    ("tracker", "modules", "extra"),
    [("TensorBoard", ("torch.utils.tensorboard", "tensorboardX"), "tensorboard"), ("WandB", ("wandb",), "wandb"),
     ("Trackio", ("trackio",), "trackio")],
)  # fmt: skip
def test_a_missing_library_names_its_extra(tracker, modules, extra, monkeypatch, tmp_path):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    args = (tmp_path,) if tracker == "TensorBoard" else ()
    with pytest.raises(ImportError, match=rf'ts.track.{tracker} needs .*pip install "torchshard\[{extra}\]"'):
        getattr(ts.track, tracker)(*args)


def test_only_the_main_process_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    model = torch.nn.Linear(4, 1)
    jsonl = ts.track.JSONL(tmp_path / "m.jsonl")
    trainer = ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.sgd(0.1),
                         ts.plan(model, ts.make_mesh({"data": 8})), log_every=1, trackers=[jsonl])  # fmt: skip
    trainer.step(torch.ones(8, 4))
    trainer.log({"x": 1.0})
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize(
    ("trackers", "message"),
    [(["tensorboard"], r"trackers\[0\] is 'tensorboard', which has no log\(step, metrics\) and close\(\) methods"),
     ([object()], r"trackers\[0\] is <object object"),
     ("tb", r"trackers must be a list of trackers"),
     (None, r"trackers must be a list of trackers")],
)  # fmt: skip
def test_unknown_trackers_are_refused_before_anything_moves(trackers, message):
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ArgumentError, match=message):
        ts.Trainer(model, lambda m, b: m(b).sum(), optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})),
                   log_every=1, trackers=trackers)  # fmt: skip
    assert model.weight.device.type == "cpu"  # nothing was placed


def test_a_single_tracker_must_come_in_a_list(tmp_path):
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ArgumentError, match=r"wrap one tracker in a list"):
        ts.Trainer(model, lambda m, b: m(b).sum(), optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})),
                   log_every=1, trackers=ts.track.JSONL(tmp_path / "m.jsonl"))  # fmt: skip


def test_unwritable_paths_are_refused_when_the_tracker_is_made(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ArgumentError, match=r"TensorBoard logdir .*file/tb' cannot be created: .*file' is a file"):
        ts.track.TensorBoard(tmp_path / "file" / "tb")
    with pytest.raises(ArgumentError, match=r"TensorBoard logdir .*file' exists and is a file"):
        ts.track.TensorBoard(tmp_path / "file")
    with pytest.raises(ArgumentError, match=r"JSONL path .* exists and is a directory"):
        ts.track.JSONL(tmp_path)
    with pytest.raises(ArgumentError, match=r"JSONL path must be a path \(str or pathlib.Path\), got int"):
        ts.track.JSONL(3)
