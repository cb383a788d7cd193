"""load_safetensors on bad input: a typed error naming the file or tensor, and the target left as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch
import torch

import torchshard as ts
from testsupport.models import tiny_llama
from torchshard import ArgumentError, CheckpointError, ShardingError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama saved as shards + index by save_safetensors (several files)."""
    out = tmp_path_factory.mktemp("sharded")
    source = tiny_llama(seed=1)
    ts.save_safetensors(out, ts.shard(source, ts.plan(source, ts.make_mesh({"data": 8}))), max_shard_bytes=100_000)
    return out


@pytest.fixture
def copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


@pytest.fixture
def target():
    model = tiny_llama(seed=2)
    return ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))


def _unchanged(target, before):
    after = ts.to_torch_state_dict(target)
    assert all(torch.equal(after[k], before[k]) for k in before)


def _raises(path, target, error, match, **kwargs):
    before = ts.to_torch_state_dict(target)
    with pytest.raises(error, match=match):
        ts.load_safetensors(path, target, **kwargs)
    _unchanged(target, before)


def _shards(folder):
    return sorted(folder.glob("model-*.safetensors"))


def test_a_missing_path(tmp_path, target):
    _raises(tmp_path / "nowhere", target, CheckpointError, r"nowhere does not exist \(the nearest existing folder")


def test_a_folder_without_a_checkpoint(tmp_path, target):
    (tmp_path / "config.json").write_text("{}")
    _raises(tmp_path, target, CheckpointError, r"holds neither model.safetensors nor .*\['config.json'\]")


def test_a_truncated_file(copy, target):
    shard = _shards(copy)[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    _raises(copy, target, CheckpointError, rf"unreadable safetensors files .*\n  - {shard}: SafetensorError")


def test_a_corrupted_header(copy, target):
    shard = _shards(copy)[0]
    shard.write_bytes(b"\xff" * 8 + shard.read_bytes()[8:])
    _raises(copy, target, CheckpointError, rf"{shard.name}: SafetensorError: Error while deserializing header")


def test_an_index_naming_a_missing_shard(copy, target):
    missing = _shards(copy)[-1]
    missing.unlink()
    _raises(copy, target, CheckpointError, rf"names shard files that are missing.*\n  - {missing.name}: named by")


def test_a_malformed_index(copy, target):
    (copy / "model.safetensors.index.json").write_text("{not json")
    _raises(copy, target, CheckpointError, r"model.safetensors.index.json is unreadable or malformed \(JSONDecodeError")


def test_an_index_putting_a_tensor_in_the_wrong_file(copy, target):
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = (
        files[0] if index["weight_map"]["model.norm.weight"] != files[0] else files[1]
    )
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    _raises(
        copy, target, CheckpointError, r"model.norm.weight: the index puts it in model-0000\d-of-\d+.safetensors, which"
    )


def _single(tmp_path, change):
    state = {k: v.clone() for k, v in tiny_llama(seed=1).state_dict().items()}
    change(state)
    safetensors.torch.save_file(state, tmp_path / "model.safetensors")
    return tmp_path


def test_a_dtype_that_cannot_be_cast(tmp_path, target):
    def complex_norm(state):
        state["model.norm.weight"] = state["model.norm.weight"].to(torch.complex64)

    match = r"uncastable model.norm.weight \(model.safetensors\): torch.complex64 into torch.float32 would drop"
    _raises(_single(tmp_path, complex_norm), target, ShardingError, match)


def test_a_shape_mismatch(tmp_path, target):
    def wider(state):
        state["model.norm.weight"] = torch.ones(65)

    _raises(
        _single(tmp_path, wider),
        target,
        ShardingError,
        r"mis-shaped model.norm.weight: checkpoint \(65,\), model \(64,\)",
    )


def test_every_name_problem_at_once_with_near_misses(tmp_path, target):
    def renamed(state):
        state["model.norm.weights"] = state.pop("model.norm.weight")
        state["extra.bias"] = torch.zeros(3)
        del state["lm_head.weight"]

    match = (
        r"\(4 problems\):\n"
        r"  - missing model.norm.weight \(64,\): in the model, not in the checkpoint "
        r"\(did you mean model.norm.weights\?\)\n"
        r"  - missing lm_head.weight \(128, 64\): in the model, not in the checkpoint\n"
        r"  - unexpected extra.bias \(3,\): in the checkpoint, not in the model\n"
        r"  - unexpected model.norm.weights \(64,\): in the checkpoint, not in the model "
        r"\(did you mean model.norm.weight\?\)"
    )
    _raises(_single(tmp_path, renamed), target, ShardingError, match)


def test_int64_values_32_bits_cannot_hold(tmp_path):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(2, dtype=torch.int64))

    safetensors.torch.save_file({"count": torch.tensor([1, 2**40])}, tmp_path / "model.safetensors")
    model = Counter()
    ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
    _raises(
        tmp_path, model, ShardingError, r"count \(2,\) torch.int64: values in \[1, 1099511627776\] do not fit int32"
    )


def test_two_names_renamed_to_one(folder, target):
    match = r"'model.layers.0.input_layernorm.weight' and '.*' are both renamed to 'x'; rename one"
    _raises(folder, target, ShardingError, match, rename=lambda n: "x" if "norm" in n else n)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rename": "model."}, r"rename is a str; rename must be a callable"),
        ({"rename": [("(", "")]}, r"rename\[0\] regex '\('"),
        ({"rename": [("a",)]}, r"rename\[0\] = \('a',\) is not a \(regex, replacement\) pair"),
        ({"strict": 1}, r"(?s)invalid load_safetensors\(\) arguments.*strict"),
        ({"plan": "plan"}, r"plan"),
    ],
)
def test_bad_arguments(folder, target, kwargs, match):
    _raises(folder, target, ArgumentError, match, **kwargs)


def test_a_rename_that_raises_is_an_argument_error_naming_the_call_and_the_name(folder, target):
    table = {"model.norm.weight": "model.norm.weight"}  # a lookup that misses the other names
    before = ts.to_torch_state_dict(target)
    match = r"rename=.*__getitem__.* raised KeyError: '.*' for the checkpoint name '.*'; nothing was loaded: fix it"
    with pytest.raises(ArgumentError, match=match) as info:
        ts.load_safetensors(folder, target, rename=table.__getitem__)
    assert isinstance(info.value.__cause__, KeyError)  # the original, kept
    _unchanged(target, before)


def test_a_meta_module_needs_a_plan(folder):
    model = tiny_llama(meta=True)
    with pytest.raises(ShardingError, match=r"not sharded; place it with torchshard.shard\(model, plan\) first"):
        ts.load_safetensors(folder, model)
