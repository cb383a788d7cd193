"""ts.track: the rows a Trainer logs, read back through each library's own files and readers."""

from __future__ import annotations

import json
import re
import struct
import sys
import time
import types

import jax
import numpy as np
import optax
import pytest
import torch

import torchshard as ts
from testsupport.full_disk import full_tmpfs, listing
from testsupport.models import MLP
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


# --- a step either happened or did not: trackers that fail, and what they are given ----------------------


class Raising(Recorder):
    """Records like `Recorder`, then raises from ``log`` (or from ``close``)."""

    def __init__(self, *, on="log", error=None):
        super().__init__()
        self.on, self.error = on, error or ValueError("the tracker's server is down")

    def log(self, step, metrics):
        super().log(step, metrics)
        if self.on == "log":
            raise self.error

    def close(self):
        super().close()
        if self.on == "close":
            raise self.error


def _trainer(trackers, *, log_every=1):
    model = torch.nn.Linear(4, 1)
    return ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.sgd(0.1),
                      ts.plan(model, ts.make_mesh({"data": 8})), log_every=log_every, trackers=trackers)  # fmt: skip


def test_a_tracker_failing_after_a_step_is_a_tracker_error_saying_the_step_was_applied():
    failing, after = Raising(), Recorder()
    trainer = _trainer([failing, after])
    with pytest.raises(ts.TrackerError, match=r"tracker <.*Raising.*> failed to log step 1 \(ValueError: the "
                                              r"tracker's server is down\); step 1 was applied: do not run it "
                                              r"again .*every other tracker logged them") as info:  # fmt: skip
        trainer.step(torch.ones(8, 4))
    assert trainer.step_count == 1  # applied once: a retry would apply it twice
    err = info.value
    assert err.tracker is failing and err.step == 1 and err.__cause__ is failing.error
    assert err.metrics == after.rows[0][1] and set(err.metrics) >= {"loss", "grad_norm", "step_time_s"}
    with pytest.raises(ts.TrackerError, match=r"failed to log step 1 .* step 1 was applied"):
        trainer.log({"eval/loss": 0.5})  # an evaluation logged at the same step: the same rule
    assert after.rows[-1] == (1, {"eval/loss": 0.5}) and trainer.step_count == 1


def test_close_closes_every_tracker_then_raises_the_first_failure():
    first, middle, last = Raising(on="close", error=OSError("a")), Recorder(), Raising(on="close", error=KeyError("b"))
    trainer = _trainer([first, middle, last], log_every=None)
    with pytest.raises(ts.TrackerError, match=r"failed to close \(OSError: a\) at step 0; step 0 was applied, and "
                                              r"every other tracker was closed; 1 more of the 3 trackers failed "
                                              r"too: .*KeyError") as info:  # fmt: skip
        trainer.close()
    assert (first.closed, middle.closed, last.closed) == (1, 1, 1)
    assert info.value.tracker is first and info.value.metrics == {} and isinstance(info.value.__cause__, OSError)


def test_a_jsonl_tracker_on_a_full_disk_is_a_tracker_error_naming_the_file_and_leaves_no_half_line(tmp_path):
    lines = [json.dumps({"step": 0, "pad": "x" * 4040}) + "\n"]  # 4,070 bytes: the next line crosses the page
    with full_tmpfs(tmp_path / "disk", before=lambda root: (root / "m.jsonl").write_text("".join(lines))) as disk:
        trainer = _trainer([ts.track.JSONL(disk / "m.jsonl"), ts.track.JSONL(disk / "new.jsonl")])
        path = re.escape(str(disk / "m.jsonl"))
        full = rf"\(OSError: \[Errno 28\] No space left on device; the line of step 1 was not written: '{path}'\)"
        with pytest.raises(ts.TrackerError, match=rf"tracker ts.track.JSONL\('{path}'\) failed to log step 1 {full}; "
                                                  rf"step 1 was applied"):  # fmt: skip
            trainer.step(torch.ones(8, 4))
        assert (disk / "m.jsonl").read_text() == "".join(lines)  # the first part of the line that fit: taken back
        assert listing(disk) == ["m.jsonl"]  # new.jsonl, which failed too, was not left behind empty


class Fake:
    def log(self, step, metrics):
        pass


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda t: ts.track.WandB(projekt="x"), r"invalid ts.track.WandB arguments .*\n  - wandb.init\(\) takes no "
                                                r"keyword 'projekt'; did you mean 'project'\?"),
        (lambda t: ts.track.WandB(project="p", colour="red"), r"takes no keyword 'colour'; its keywords: entity, proj"),
        (lambda t: ts.track.Trackio(projekt="x"), r"trackio.init\(\) takes no keyword 'projekt'; did you mean"),
        (lambda t: ts.track.JSONL(t), r"JSONL path .* exists and is a directory"),
        (lambda t: ts.track.JSONL(None), r"JSONL path must be a path \(str or pathlib.Path\), got NoneType"),
        (lambda t: ts.track.TensorBoard(b"tb"), r"TensorBoard logdir must be a path .*got bytes"),
        (lambda t: _trainer([ts.track.JSONL(t / "m.jsonl")], log_every="10"), r"log_every='10' must be an int"),
        (lambda t: _trainer([Fake()]), r"trackers\[0\] is <.*Fake.*>, which has no log\(step, metrics\) and close"),
        (lambda t: _trainer((ts.track.JSONL(t / "m.jsonl"),) * 2, log_every=0), r"log_every=0 must be an int"),
    ],
    ids=["wandb_typo", "wandb_unknown", "trackio_typo", "jsonl_dir", "jsonl_none", "tensorboard_bytes",
         "log_every_str", "no_close", "log_every_zero"],
)  # fmt: skip
def test_tracker_arguments_are_refused_before_a_run_or_a_step(make, message, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    fake = types.ModuleType("trackio")  # trackio's API as it is documented: keywords only these
    fake.init = lambda project=None, name=None, config=None, space_id=None: None
    monkeypatch.setitem(sys.modules, "trackio", fake)
    with pytest.raises(ArgumentError, match=message):
        make(tmp_path)
    assert sys.modules.get("wandb") is None or sys.modules["wandb"].run is None  # no run was started


def test_wandb_keywords_are_checked_again_when_the_trainer_is_built(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    tracker = ts.track.WandB(project="p")  # right here; changed before the Trainer takes it
    tracker.init_kwargs["nmae"] = "run"
    with pytest.raises(ArgumentError, match=r"trackers\[0\]: wandb.init\(\) takes no keyword 'nmae'; did you mean "
                                            r"'name'\?"):  # fmt: skip
        _trainer([tracker])
    assert sys.modules["wandb"].run is None


@pytest.mark.parametrize(
    ("metrics", "kwargs", "message"),
    [({"note": "high"}, {}, r"metric 'note' is a str \('high'\); trackers log numbers"),
     ({"x": torch.ones(3)}, {}, r"metric 'x' has shape \(3,\), not one value; log a scalar"),
     ({"x": np.ones((2, 2))}, {}, r"metric 'x' has shape \(2, 2\)"),
     ({"x": None}, {}, r"metric 'x' is a NoneType \(None\), not a number"),
     ({3: 1.0}, {}, r"metric name 3 is a int; names are strings"),
     ([("loss", 1.0)], {}, r"metrics must be a dict name → number, got list"),
     ({"x": 1.0}, {"prefix": 3}, r"prefix=3 must be a string such as 'eval/'"),
     ({"a": "1", "b": torch.ones(2)}, {"prefix": None}, r"\(3 problems\)")],
    ids=["str", "tensor3", "array2x2", "none", "int_name", "list", "prefix_int", "all_at_once"],
)  # fmt: skip
def test_trainer_log_names_every_metric_it_cannot_log_and_logs_none(metrics, kwargs, message):
    recorder = Recorder()
    trainer = _trainer([recorder])
    with pytest.raises(ArgumentError, match=message):
        trainer.log(metrics, **kwargs)
    assert recorder.rows == []


def test_trainer_log_takes_scalars_of_every_kind():
    recorder = Recorder()
    trainer = _trainer([recorder])
    logged = trainer.log({"a": torch.tensor(1.5), "b": np.float32(2), "c": jax.numpy.ones((1,)), "d": 3, "e": True})
    assert logged == {"a": 1.5, "b": 2.0, "c": 1.0, "d": 3.0, "e": 1.0} and recorder.rows == [(0, logged)]
