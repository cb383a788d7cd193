"""Exports: plain torch state_dicts (loadable without JAX), state_dicts placed onto plans, safetensors."""

from __future__ import annotations

import copy
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
import torch
from torch import nn

import torchshard as ts
from testsupport.checkpoint_runs import TP_LM, Run, lm_batches, make_trainer, read_safetensors, sharded, values
from testsupport.helpers import root_env
from testsupport.models import FusedQKV, Rotary, TiedLM
from torchshard import presets
from torchshard._bridge.tensors import wrap


def test_to_torch_state_dict_is_plain_torch_with_ties_and_dtypes(mesh_dm):
    torch.manual_seed(0)
    reference = nn.Sequential(TiedLM(), nn.BatchNorm1d(64))  # BatchNorm adds an int64 buffer
    model = copy.deepcopy(reference)
    run = Run(lambda: model, lambda m, b: m[0](b).sum(), lambda: optax.sgd(0.0), None, lm_batches)
    trainer = make_trainer(run, mesh_dm, presets.fsdp(min_size=64), torch_seed=0, seed=0)
    state = ts.to_torch_state_dict(trainer)
    expected = reference.state_dict()
    assert list(state) == list(expected)
    for name, tensor in state.items():
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu", name
        assert tensor.dtype == expected[name].dtype, name
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    assert state["0.head.weight"] is state["0.embed.weight"]


SUBPROCESS = """
import sys
import torch
from testsupport.models import FusedQKV, Rotary, TiedLM
torch.manual_seed(123)
model = TiedLM()
model.load_state_dict(torch.load(sys.argv[1]))
assert model.head.weight is model.embed.weight
torch.save(model(torch.load(sys.argv[2])).detach(), sys.argv[3])
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "torchax", "torchshard"))
assert not leaked, leaked
"""


@pytest.mark.slow
def test_exported_state_dict_loads_in_a_process_without_jax(tmp_path, mesh_dm):
    torch.manual_seed(0)
    reference = TiedLM()
    model = ts.shard(copy.deepcopy(reference), ts.plan(copy.deepcopy(reference), mesh_dm, TP_LM))
    ids = lm_batches(1)[0][:, :-1]
    torch.save(ts.to_torch_state_dict(model), tmp_path / "model.pt")
    torch.save(ids, tmp_path / "ids.pt")
    files = [str(tmp_path / f) for f in ("model.pt", "ids.pt", "out.pt")]
    done = subprocess.run([sys.executable, "-c", SUBPROCESS, *files], env=root_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), reference(ids), rtol=0, atol=0)


def test_from_torch_state_dict_places_a_plain_state_dict_onto_a_plan(mesh_fsdp):
    torch.manual_seed(0)
    reference = TiedLM()
    with torch.device("meta"):
        model = TiedLM()
    p = ts.plan(model, mesh_fsdp, presets.fsdp(min_size=64))
    assert ts.from_torch_state_dict(model, reference.state_dict(), p) is model
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.jax().sharding == p["embed.weight"]
    jax.tree.map(np.testing.assert_array_equal, values(model), values(reference))


def test_from_torch_state_dict_lists_every_problem(mesh_fsdp):
    state = TiedLM().state_dict()
    del state["norm.bias"]
    state["block.up.weight"] = torch.zeros(3, 3)
    state["extra"] = torch.zeros(2)
    model = TiedLM()
    with pytest.raises(
        ts.ShardingError, match=r"state_dict does not fit TiedLM; load it into the model it came from \(3 problems\)"
    ) as info:
        ts.from_torch_state_dict(model, state, ts.plan(model, mesh_fsdp))
    assert info.value.problems == (
        "missing norm.bias (32,): in the model, not in the state_dict",
        "unexpected extra (2,): in the state_dict, not in the model",
        "mis-shaped block.up.weight: state_dict (3, 3), model (64, 32)",
    )


def test_save_safetensors_writes_hf_style_shards_with_ties_stored_once(tmp_path, mesh_dm):
    model = sharded(TiedLM, mesh_dm, TP_LM)
    (tmp_path / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    assert ts.save_safetensors(tmp_path, model, max_shard_bytes=9000) == tmp_path / "model.safetensors.index.json"
    index, tensors = read_safetensors(tmp_path)
    state = ts.to_torch_state_dict(model)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert set(tensors) == set(index["weight_map"]) == set(state) - {"head.weight"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    fresh = TiedLM()
    assert fresh.load_state_dict(tensors, strict=False).missing_keys == ["head.weight"]
    torch.testing.assert_close(fresh.head.weight, state["head.weight"], rtol=0, atol=0)


def test_complex_buffers_export_to_torch_and_safetensors(tmp_path, mesh_fsdp):
    reference = Rotary()
    model = ts.shard(copy.deepcopy(reference), ts.plan(reference, mesh_fsdp))
    state = ts.to_torch_state_dict(model)
    assert state["freqs_cis"].dtype == torch.complex64
    torch.testing.assert_close(state["freqs_cis"], reference.freqs_cis, rtol=0, atol=0)
    ts.save_safetensors(tmp_path, model)  # safetensors holds complex64 (C64)
    torch.testing.assert_close(read_safetensors(tmp_path)[1]["freqs_cis"], reference.freqs_cis, rtol=0, atol=0)


def test_a_tensor_torch_has_no_dtype_for_is_a_checkpoint_error_naming_it(tmp_path, mesh_fsdp):
    model = nn.Linear(4, 4)
    ts.shard(model, ts.plan(model, mesh_fsdp))
    model.register_buffer("packed", wrap(jax.numpy.ones((8, 2), jax.numpy.int4)))
    for export in (ts.to_torch_state_dict, lambda m: ts.save_safetensors(tmp_path, m)):
        with pytest.raises(ts.CheckpointError, match=r"packed \(8, 2\) int4: torch has no dtype for it"):
            export(model)
    assert not (tmp_path.parent / (".torchshard-tmp-" + tmp_path.name)).exists()  # the failed export left nothing


@pytest.mark.parametrize("private_hook", [False, True], ids=["post_hook", "private_hook"])
def test_state_dict_hooks_run_on_gathered_cpu_tensors_as_torch_runs_them(tmp_path, mesh_dm, private_hook):
    torch.manual_seed(0)
    reference = nn.Sequential(FusedQKV(private_hook=private_hook), nn.LayerNorm(16))
    expected = reference.state_dict()
    assert "0.q.weight" in expected and "0.qkv.weight" not in expected
    model = copy.deepcopy(reference)
    ts.shard(model, ts.plan(model, mesh_dm, presets.tensor_parallel(colwise=[r"0\.qkv"], rowwise=[r"0\.out"])))
    state = ts.to_torch_state_dict(model)
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    ts.save_safetensors(tmp_path, model)
    index, stored = read_safetensors(tmp_path)
    assert set(stored) == set(expected) == set(index["weight_map"])
    for name, tensor in expected.items():
        torch.testing.assert_close(stored[name], tensor, rtol=0, atol=0)
