"""Data-loader state in checkpoints: pickle-free encoding, exact resumption of a StatefulDataLoader, bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from typing import Any

import numpy as np
import optax
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

import torchshard as ts
from testsupport.checkpoint_runs import Cursor
from torchshard._ckpt import meta as _ckpt_meta
from torchshard._ckpt.datastate import data_entry, data_entry_problems, decode, encode


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (tensors and arrays by dtype, shape and bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
    if isinstance(a, np.ndarray | np.generic):
        return a.dtype == b.dtype and np.shape(a) == np.shape(b) and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


STATES = {  # what loaders and samplers keep in their state dicts
    "plain": {"epoch": 2, "seen": 17, "name": "train", "done": False, "rate": 0.25, "none": None, "list": [1, [2]]},
    "tuples": {"python_random": (3, (1, 2, 3), None), "nested": [(1, 2), ()]},
    "non_string_keys": {0: "worker 0", (1, 2): [3], 2.5: "x", None: 1, True: 0},
    "generator": {"generator": torch.Generator().manual_seed(3).get_state()},
    "tensors": {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "int64_scalar": torch.tensor(2**40),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    },
    "numpy": {"array": np.arange(6, dtype=np.int16).reshape(2, 3), "scalar": np.float32(1.5), "bytes": b"\x00\xff"},
    "tag_as_a_key": {"__torchshard__": "tensor", "data": "not one"},
}


@pytest.mark.parametrize("name", STATES)
def test_a_state_round_trips_exactly_through_pickle_free_json(name):
    raw = encode(STATES[name])
    json.loads(raw)  # plain JSON
    assert same(decode(raw), STATES[name])


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (
            {"lock": threading.Lock()},
            r"state holds a lock at state\['lock'\], which a checkpoint stores only as pickle-free JSON",
        ),
        ({"rows": [1, {2, 3}]}, r"holds a set at state\['rows'\]\[1\].*e\.g\. a torch\.Generator as"),
        ({"objects": np.array([object()])}, r"holds a numpy array of Python objects"),
    ],
    ids=["lock", "set", "object_array"],
)
def test_a_state_json_cannot_hold_is_an_argument_error_naming_where(state, match):
    with pytest.raises(ts.ArgumentError, match=match):
        encode(state, what="state")


def _trainer(mesh, seed: int = 0) -> ts.Trainer:
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 1)
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[1]), b[2])  # noqa: E731
    return ts.Trainer(model, loss_fn, optax.adamw(1e-2), ts.plan(model, mesh))


def _loader(seed: int = 7) -> StatefulDataLoader:
    g = torch.Generator().manual_seed(0)
    rows = torch.utils.data.TensorDataset(
        torch.arange(24), torch.randn(24, 6, generator=g), torch.randn(24, 1, generator=g)
    )
    # torchdata's own RandomSampler: with shuffle=True, torchdata 0.11 restores the interrupted epoch's order
    # but not the generator that shuffles the epochs after it
    sampler = RandomSampler(rows, generator=torch.Generator().manual_seed(seed))
    return StatefulDataLoader(rows, batch_size=8, sampler=sampler)


def _batches(loader: StatefulDataLoader):
    while True:  # epoch after epoch, each reshuffled
        yield from loader


def _train(trainer: ts.Trainer, batches, steps: int) -> tuple[list[list[int]], list[float]]:
    seen, losses = [], []
    for _, batch in zip(range(steps), batches, strict=False):
        seen.append(batch[0].tolist())
        losses.append(float(trainer.step(batch)["loss"]))
    return seen, losses


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_a_resumed_loader_gives_the_batches_and_losses_of_an_uninterrupted_run(tmp_path, mesh_fsdp, background):
    """3 batches an epoch: interrupted mid-epoch 2, resumed into new objects, through epoch 3."""
    full = _train(_trainer(mesh_fsdp), _batches(_loader()), 8)
    trainer, loader = _trainer(mesh_fsdp), _loader()
    batches = _batches(loader)
    first = _train(trainer, batches, 4)
    saved = ts.save(tmp_path, trainer, data=loader, background=background)
    if background:  # the state of the call: the batches drawn meanwhile are not in it
        _train(trainer, batches, 2)
        saved = saved.result()
    assert sorted(p.name for p in (saved / "data").iterdir()) == ["process_0.json"]
    resumed, loader = _trainer(mesh_fsdp, seed=1), _loader(seed=99)
    assert ts.load(tmp_path, resumed, data=loader) is resumed
    rest = _train(resumed, _batches(loader), 4)
    assert first[0] + rest[0] == full[0]
    assert first[1] + rest[1] == full[1]  # the same program on the same inputs: bit for bit


def test_a_sampler_state_comes_back_into_a_module_checkpoint(tmp_path, mesh_dm):
    model = ts.shard(torch.nn.Linear(4, 2), ts.plan(torch.nn.Linear(4, 2), mesh_dm))
    cursor = Cursor(seed=5)
    cursor.next()
    ts.save(tmp_path, model, data=cursor)
    expected = cursor.next()
    resumed = Cursor(seed=0)
    ts.load(tmp_path, model, data=resumed)
    assert (resumed.seen, resumed.next()) == (1, expected)


# --- bad input ------------------------------------------------------------------------------------


class OnlySaves:
    def state_dict(self) -> dict[str, int]:
        return {}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            [1, 2],
            r"data=\[1, 2\] \(a list\) has no state_dict\(\) and no load_state_dict\(\); pass an object with both",
        ),
        (OnlySaves(), r"data=<.*> \(a OnlySaves\) has no load_state_dict\(\); pass .*StatefulDataLoader"),
    ],
    ids=["list", "no_load_state_dict"],
)
@pytest.mark.parametrize("call", ["save", "load"])
def test_data_without_state_dict_methods_is_an_argument_error(tmp_path, mesh_dm, call, data, match):
    model = ts.shard(torch.nn.Linear(4, 2), ts.plan(torch.nn.Linear(4, 2), mesh_dm))
    ts.save(tmp_path, model, data=Cursor())
    with pytest.raises(ts.ArgumentError, match=rf"invalid {call}\(\) arguments .*\n  - {match}"):
        getattr(ts, call)(tmp_path, model, data=data)
    assert ts.checkpoint_steps(tmp_path) == [0]


def test_a_state_json_cannot_hold_fails_the_save_before_anything_is_written(tmp_path, mesh_dm):
    model = ts.shard(torch.nn.Linear(4, 2), ts.plan(torch.nn.Linear(4, 2), mesh_dm))
    cursor = Cursor()
    cursor.state_dict = lambda: {"generator": torch.Generator()}  # type: ignore[method-assign]
    with pytest.raises(
        ts.ArgumentError, match=r"data=Cursor\.state_dict\(\) holds a Generator at state\['generator'\]"
    ):
        ts.save(tmp_path, model, data=cursor, background=True)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_a_loader_whose_state_dict_raises_fails_the_save_naming_the_call_before_anything_is_written(
    tmp_path, mesh_dm, background
):
    model = ts.shard(torch.nn.Linear(4, 2), ts.plan(torch.nn.Linear(4, 2), mesh_dm))
    cursor = Cursor()
    cursor.state_dict = lambda: {}["position"]  # type: ignore[method-assign]
    want = r"data=Cursor\.state_dict\(\) raised KeyError: 'position'; nothing was saved: fix the loader"
    with pytest.raises(ts.CheckpointError, match=want) as info:
        ts.save(tmp_path, model, data=cursor, background=background)
    assert isinstance(info.value.__cause__, KeyError)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize("background", [False, True], ids=["sync", "background"])
def test_a_meta_tensor_in_the_state_fails_the_save_naming_where_before_anything_is_written(
    tmp_path, mesh_dm, background
):
    model = ts.shard(torch.nn.Linear(4, 2), ts.plan(torch.nn.Linear(4, 2), mesh_dm))
    cursor = Cursor()
    cursor.state_dict = lambda: {"sampler": [1, torch.empty(3, 2, device="meta")]}  # type: ignore[method-assign]
    want = r"data=Cursor\.state_dict\(\) holds a meta tensor \(3, 2\) float32 at state\['sampler'\]\[1\], which has no"
    with pytest.raises(ts.CheckpointError, match=want):
        ts.save(tmp_path, model, data=cursor, background=background)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_loading_data_from_a_checkpoint_without_it_is_a_checkpoint_error_that_changes_nothing(tmp_path, mesh_dm):
    trainer = _trainer(mesh_dm)
    ts.save(tmp_path, trainer, step=3)
    fresh, cursor = _trainer(mesh_dm, seed=1), Cursor(seed=2)
    state = cursor.state_dict()
    match = r"checkpoint .*step_00000003 holds no data state \(it was saved without data=\); load it without data="
    with pytest.raises(ts.CheckpointError, match=match):
        ts.load(tmp_path, fresh, data=cursor)
    assert fresh.step_count == 0 and same(cursor.state_dict(), state)


@pytest.fixture
def saved_with_data(tmp_path, mesh_dm):
    model = ts.shard(torch.nn.Linear(4, 2), ts.plan(torch.nn.Linear(4, 2), mesh_dm))
    return ts.save(tmp_path, model, data=Cursor(seed=1)), model


def _rewrite_meta(step_dir, change) -> None:
    meta = json.loads((step_dir / "torchshard.json").read_text())
    meta.pop("digest")
    change(meta)
    _ckpt_meta.write_meta(step_dir, meta)


def test_a_damaged_data_state_is_a_checkpoint_error(saved_with_data):
    step_dir, model = saved_with_data
    file = step_dir / "data" / "process_0.json"
    raw = bytearray(file.read_bytes())
    raw[10] ^= 1
    file.write_bytes(bytes(raw))  # same size: only the checksum tells
    with pytest.raises(ts.CheckpointError, match=r"process_0\.json: checksum mismatch, .*load an earlier step"):
        ts.load(step_dir, model, data=Cursor())
    file.write_bytes(bytes(raw[:20]))
    assert ts.checkpoint_steps(step_dir.parent) == []  # truncated: not a complete step
    with pytest.raises(ts.CheckpointError, match=r"incomplete or truncated.*\n  - data/process_0\.json: 20 bytes"):
        ts.load(step_dir, model, data=Cursor())


def test_a_data_state_saved_by_another_number_of_processes_is_a_checkpoint_error(saved_with_data):
    step_dir, model = saved_with_data
    shutil.copy(step_dir / "data" / "process_0.json", step_dir / "data" / "process_1.json")
    _rewrite_meta(step_dir, lambda m: m["data"].update(processes=2, files=m["data"]["files"] | {
        "data/process_1.json": m["data"]["files"]["data/process_0.json"]}))  # fmt: skip
    match = r"holds the data state of 2 process\(es\), this run has 1; .*resume with 2 process\(es\)"
    with pytest.raises(ts.CheckpointError, match=match):
        ts.load(step_dir, model, data=Cursor())
    ts.load(step_dir, model)  # without data= it loads


def test_a_malformed_data_entry_is_a_checkpoint_error_naming_the_file(saved_with_data):
    step_dir, model = saved_with_data
    _rewrite_meta(step_dir, lambda m: m["data"].update(processes=3))
    with pytest.raises(ts.CheckpointError, match=r"torchshard\.json is unreadable or malformed.*\n  - data \{"):
        ts.load(step_dir, model)


class Picky(Cursor):
    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise KeyError("no 'shard' in this state")


def test_a_loader_that_rejects_its_state_is_a_checkpoint_error_that_changes_nothing(saved_with_data, mesh_dm):
    step_dir, model = saved_with_data
    before = {k: v.jax() for k, v in model.state_dict().items()}
    other = torch.nn.Linear(4, 2)
    ts.save(step_dir.parent, ts.shard(other, ts.plan(other, mesh_dm)), step=1, data=Cursor())
    match = r"Picky\.load_state_dict rejected the data state of .*step_00000001 \(KeyError: .*\); the model and optim"
    with pytest.raises(ts.CheckpointError, match=match):
        ts.load(step_dir.parent, model, data=Picky())
    assert all(v.jax() is before[k] for k, v in model.state_dict().items())


def test_data_on_some_processes_only_is_a_checkpoint_error():
    record = json.dumps({"file": "data/process_1.json", "size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()})
    with pytest.raises(ts.CheckpointError, match=r"given on process\(es\) \[1\] but not on \[0\]; .*on every process"):
        data_entry(["", record])
    assert data_entry(["", ""]) is None


@pytest.mark.parametrize(
    "entry",
    [[], {"processes": 1, "files": {}}, {"processes": 1, "files": {"data/process_0.json": {"size": "9"}}}],
    ids=["a_list", "a_file_missing", "no_checksum"],
)
def test_data_entry_problems(entry):
    assert data_entry_problems(entry) == [
        f"data {entry!r:.80} is not a process count and each process's file with its size and sha256"
    ]
