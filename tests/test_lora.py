"""peft LoRA under torchshard: layouts, training against eager torch, frozen base weights, adapter exports."""

from __future__ import annotations

import copy
import errno

import jax
import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P

import torchshard as ts
from testsupport.helpers import torch_losses
from testsupport.models import tiny_llama
from testsupport.peft_lora import LR, RULES, WD, lm_loss, lora
from torchshard import presets

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PREFIX = "base_model.model.model.layers.0.self_attn."


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("q_proj.base_layer.weight", P("model", "data")),  # as the tp_plan says for q_proj, + FSDP
        ("q_proj.lora_B.default.weight", P("model", None)),  # [out, r]: split like the base weight's out dim
        ("q_proj.lora_A.default.weight", P()),
        ("o_proj.base_layer.weight", P("data", "model")),
        ("o_proj.lora_A.default.weight", P(None, "model")),  # [r, in]: split like the base weight's in dim
        ("o_proj.lora_B.default.weight", P()),
        ("k_proj.weight", P("model", "data")),  # not wrapped
    ],
)
def test_hf_rules_lay_out_peft_wrapped_modules(mesh_dm, name, spec):
    model = lora(tiny_llama(meta=True))
    assert ts.plan(model, mesh_dm, presets.hf_rules(model, fsdp_min_size=1024)).spec(PREFIX + name) == spec


def test_tensor_parallel_lays_out_peft_wrapped_modules(mesh_dm):
    model = lora(tiny_llama(meta=True))
    rules = presets.tensor_parallel(colwise=[r".*\.(q|k|v)_proj"], rowwise=[r".*\.o_proj"])
    plan = ts.plan(model, mesh_dm, rules)
    assert plan.spec(PREFIX + "q_proj.base_layer.weight") == P("model", None)
    assert plan.spec(PREFIX + "v_proj.lora_B.default.weight") == P("model", None)
    assert plan.spec(PREFIX + "v_proj.lora_A.default.weight") == P()
    assert plan.spec(PREFIX + "o_proj.base_layer.weight") == P(None, "model")
    assert plan.spec(PREFIX + "o_proj.lora_A.default.weight") == P(None, "model")
    assert plan.spec(PREFIX + "o_proj.lora_B.default.weight") == P()


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _trained(kind, data):
    axes, rules = RULES[kind]
    model = lora(tiny_llama(seed=1))
    trainer = ts.Trainer(
        model, lm_loss, optax.adamw(LR, weight_decay=WD), ts.plan(model, ts.make_mesh(axes), rules(model))
    )
    return trainer, [float(trainer.step(b)["loss"]) for b in data]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(RULES))
def test_lora_training_matches_eager_and_leaves_the_base_alone(kind):
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (8, 12), generator=g) for _ in range(4)]
    ref = lora(tiny_llama(seed=1))
    base = {n: t.clone() for n, t in ref.state_dict().items() if "lora_" not in n}
    trainable = [p for p in ref.parameters() if p.requires_grad]
    expected = torch_losses(ref, lm_loss, torch.optim.AdamW(trainable, lr=LR, weight_decay=WD), data)
    trainer, losses = _trained(kind, data)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    # frozen: no gradient, no optimizer state; AdamW holds mu and nu for the adapters alone (+ its step count)
    adapters = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert set(trainer.state.params) == adapters
    adapter_bytes = sum(p.numel() * 4 for p in trainable)
    assert _nbytes(trainer.state.opt_state) == 2 * adapter_bytes + 4
    state = ts.to_torch_state_dict(trainer)
    for name, value in base.items():
        assert torch.equal(state[name], value), name  # bit-identical after training


@pytest.fixture(scope="module")
def trained():
    g = torch.Generator().manual_seed(0)
    return _trained("fsdp_tp", [torch.randint(0, 128, (8, 12), generator=g) for _ in range(2)])[0]


def test_adapters_export_in_peft_format(trained, tmp_path):
    path = ts.save_adapters(tmp_path, trained)
    assert path == tmp_path / "adapter_model.safetensors"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in tmp_path.iterdir()}
    loaded = peft.PeftModel.from_pretrained(tiny_llama(seed=1), tmp_path)
    state, expected = loaded.state_dict(), ts.to_torch_state_dict(trained)
    assert set(state) == set(expected)
    assert all(torch.equal(state[n], expected[n]) for n in expected)


def test_merged_export_loads_without_peft(trained, tmp_path):
    ts.save_adapters(tmp_path, trained, merged=True)
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    eager = lora(tiny_llama(seed=1))
    eager.load_state_dict(ts.to_torch_state_dict(trained))
    expected = eager.merge_and_unload().state_dict()
    state = merged.state_dict()
    assert list(state) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


def test_save_adapters_needs_a_peft_model(tmp_path):
    model = tiny_llama()
    ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
    with pytest.raises(ts.ArgumentError, match=r"target's model is a LlamaForCausalLM, not a peft model; wrap it"):
        ts.save_adapters(tmp_path, model)


def peft_llama() -> torch.nn.Module:
    """The CLI's factory: a tiny Llama wrapped by peft (built on meta by the CLI)."""
    return lora(tiny_llama())


def test_cli_preset_hf_lays_out_a_peft_model(capsys):
    import json

    from torchshard.__main__ import EXIT_OK, main

    code = main(["plan", "test_lora:peft_llama", "--mesh", "data=4,model=2", "--preset", "hf", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    specs = {r["name"]: r["spec"] for r in json.loads(out)["tensors"]}
    assert specs[PREFIX + "q_proj.lora_B.default.weight"] == str(P("model", None))
    assert specs[PREFIX + "o_proj.lora_A.default.weight"] == str(P(None, "model"))
    assert specs[PREFIX + "o_proj.base_layer.weight"] == str(P("data", "model"))


@pytest.mark.parametrize("merged", ["no", 0, None])
def test_save_adapters_takes_merged_as_a_bool_only(trained, tmp_path, merged):
    with pytest.raises(ts.ArgumentError, match=rf"merged must be True or False, got {type(merged).__name__}"):
        ts.save_adapters(tmp_path / "out", trained, merged=merged)
    assert not (tmp_path / "out").exists()


def _disk_full_after(written: list, real):
    """A file writer that writes the file, then fails as a full disk does (the file half there)."""

    def write(tensors, filename, *args, **kwargs):
        real(tensors, filename, *args, **kwargs)
        written.append(filename)
        raise OSError(errno.ENOSPC, "No space left on device")

    return write


@pytest.mark.parametrize("existing", [False, True], ids=["new", "over_an_export"])
@pytest.mark.parametrize("merged", [False, True], ids=["adapters", "merged"])
def test_a_full_disk_leaves_nothing_behind(trained, tmp_path, monkeypatch, merged, existing):
    import safetensors.torch
    from peft import peft_model

    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "README.md").write_text("mine")
        (out / "adapter_model.safetensors").write_bytes(b"old")
    before = {p.name: p.read_bytes() for p in out.iterdir()} if existing else None
    written: list = []
    monkeypatch.setattr(peft_model, "safe_save_file", _disk_full_after(written, safetensors.torch.save_file))
    monkeypatch.setattr(safetensors.torch, "save_file", _disk_full_after(written, safetensors.torch.save_file))
    with pytest.raises(ts.CheckpointError, match=r"out: the disk is full \(No space left on device\); the previous"):
        ts.save_adapters(out, trained, merged=merged)
    assert written  # the fault struck midway, after a file was written
    assert ({p.name: p.read_bytes() for p in out.iterdir()} if out.exists() else None) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if existing else [])  # no staging left


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::torchshard.UnusedRuleWarning")  # the tiny config leaves out the dense MLP
@pytest.mark.filterwarnings("ignore:The following .*_pattern keys did not match:RuntimeWarning")  # peft's own
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft on transformers 5
def test_lora_on_stacked_moe_experts_trains_like_eager():
    """peft wraps transformers' stacked experts (gate_up_proj/down_proj parameters) in a ParamWrapper, whose
    forward registers a parametrization: torch calls ``set_`` of the parameter onto itself every step."""
    from tools.families import build, family

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (8, 12), generator=g) for _ in range(4)]
    torch.manual_seed(0)  # peft's initialisation of the adapters
    model = lora(build(family("deepseek_v2")), ["gate_proj", "up_proj", "down_proj", "q_b_proj", "o_proj"])
    assert any(isinstance(m, peft.tuners.lora.layer.ParamWrapper) for m in model.modules())  # the case under test
    ref = copy.deepcopy(model)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    expected = torch_losses(ref, lm_loss, torch.optim.AdamW(trainable, lr=LR, weight_decay=WD), data)
    axes, rules = RULES["fsdp_tp"]
    trainer = ts.Trainer(
        model, lm_loss, optax.adamw(LR, weight_decay=WD), ts.plan(model, ts.make_mesh(axes), rules(model))
    )
    np.testing.assert_allclose([float(trainer.step(b)["loss"]) for b in data], expected, rtol=1e-4)
