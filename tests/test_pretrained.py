"""load_safetensors: a Hugging Face checkpoint into every kind of target, against transformers' from_pretrained."""

from __future__ import annotations

import logging

import numpy as np
import optax
import pytest
import torch

import torchshard as ts
from testsupport.helpers import assert_close, torch_losses
from testsupport.models import tiny_llama
from tools.families import DENSE, build
from torchshard import presets

transformers = pytest.importorskip("transformers")

LR, WD = 1e-3, 0.01
LAYERS = 4  # a pipeline of 2 stages × 2 layers
MESH_DM = {"data": 4, "model": 2}


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama as save_pretrained writes it (one model.safetensors), seed 1."""
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama(layers=LAYERS, seed=1).save_pretrained(folder)
    return folder


def reference(folder, **kwargs) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(folder, **kwargs)


def assert_state_equal(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, name
        assert torch.equal(actual[name], value), name


def _trainer(model, axes, rules, **kwargs):
    plan = ts.plan(model, ts.make_mesh(axes), rules(model))
    return ts.Trainer(model, lm_loss, optax.adamw(LR, weight_decay=WD), plan, **kwargs)


TARGETS = {
    "trainer_fsdp": lambda: _trainer(tiny_llama(layers=LAYERS), {"data": 8}, lambda m: presets.fsdp(min_size=256)),
    "trainer_fsdp_tp": lambda: _trainer(tiny_llama(layers=LAYERS), {"data": 4, "model": 2}, presets.hf_rules),
    "trainer_scan": lambda: _trainer(tiny_llama(layers=LAYERS), MESH_DM, presets.hf_rules, scan_layers=True),
    "sharded_module": lambda: ts.shard(m := tiny_llama(layers=LAYERS), ts.plan(m, ts.make_mesh({"data": 8}))),
}


@pytest.mark.parametrize("kind", list(TARGETS))
def test_state_dict_equals_from_pretrained(pretrained, kind):
    target = TARGETS[kind]()
    assert ts.load_safetensors(pretrained, target) is target
    assert_state_equal(ts.to_torch_state_dict(target), reference(pretrained).state_dict())


def test_meta_module_with_plan_holds_only_its_shards(pretrained):
    model = tiny_llama(layers=LAYERS, meta=True)
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), presets.hf_rules(model, fsdp_min_size=256))
    ts.load_safetensors(pretrained, model, plan)
    assert model.model.layers[0].mlp.up_proj.weight.jax().sharding == plan["model.layers.0.mlp.up_proj.weight"]
    # non-persistent buffers (rotary frequencies) are computed as transformers does, not read
    assert_state_equal(ts.to_torch_state_dict(model), reference(pretrained).state_dict())
    expected = dict(reference(pretrained).named_buffers())
    for name, buffer in model.named_buffers():
        np.testing.assert_array_equal(np.asarray(buffer.jax()), expected[name].numpy(), err_msg=name)


def test_bf16_checkpoint_fills_fp32_masters_as_load_state_dict(tmp_path):
    source = tiny_llama(seed=1).to(torch.bfloat16)
    source.save_pretrained(tmp_path)
    model = tiny_llama(seed=2)
    trainer = _trainer(model, {"data": 8}, lambda m: presets.fsdp(min_size=256))
    ts.load_safetensors(tmp_path, trainer)
    expected = tiny_llama(seed=3)
    expected.load_state_dict(source.state_dict())  # torch's own copy, bf16 → fp32
    assert_state_equal(ts.to_torch_state_dict(trainer), expected.state_dict())


def test_tied_weights_are_read_once(tmp_path, caplog):
    tiny_llama(seed=1, tie_word_embeddings=True).save_pretrained(tmp_path)
    model = tiny_llama(seed=2, tie_word_embeddings=True)
    trainer = _trainer(model, {"data": 8}, lambda m: presets.fsdp(min_size=256))
    with caplog.at_level(logging.INFO, logger="torchshard"):
        ts.load_safetensors(tmp_path, trainer)
    state = ts.to_torch_state_dict(trainer)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert_state_equal(state, reference(tmp_path).state_dict())
    read, total = (int(w) for w in caplog.records[-1].getMessage().split() if w.isdigit())
    assert read == total  # one process holding every device: each distinct slice once, the tied tensor once


def test_sharded_index_layout_from_save_safetensors(pretrained, tmp_path):
    source = ts.shard(m := reference(pretrained), ts.plan(m, ts.make_mesh({"data": 8})))
    index = ts.save_safetensors(tmp_path, source, max_shard_bytes=100_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2 and index.exists()
    model = tiny_llama(layers=LAYERS, meta=True)
    ts.load_safetensors(tmp_path, model, ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), presets.hf_rules(model)))
    assert_state_equal(ts.to_torch_state_dict(model), reference(pretrained).state_dict())


def test_a_single_file(pretrained):
    model = tiny_llama(layers=LAYERS, meta=True)
    ts.load_safetensors(pretrained / "model.safetensors", model, ts.plan(model, ts.make_mesh({"data": 8})))
    assert_state_equal(ts.to_torch_state_dict(model), reference(pretrained).state_dict())


def _base_model_checkpoint(pretrained, folder):
    reference(pretrained).model.save_pretrained(folder)  # a LlamaModel: "layers.0...", no "model." prefix


@pytest.mark.parametrize(
    "rename",
    [[(r"^", "model.")], lambda name: "model." + name],
    ids=["regex_table", "callable"],
)
def test_rename_maps_a_base_models_names(pretrained, tmp_path, rename):
    _base_model_checkpoint(pretrained, tmp_path)
    trainer = _trainer(tiny_llama(layers=LAYERS), {"data": 8}, lambda m: presets.fsdp(min_size=256))
    head = ts.to_torch_state_dict(trainer)["lm_head.weight"]
    ts.load_safetensors(tmp_path, trainer, rename=rename, strict=False)  # the base model has no lm_head
    state, expected = ts.to_torch_state_dict(trainer), reference(pretrained).state_dict()
    assert torch.equal(state.pop("lm_head.weight"), head)  # kept
    assert_state_equal(state, {k: v for k, v in expected.items() if k != "lm_head.weight"})


def test_rename_to_none_drops_a_tensor_which_keeps_the_models_values(pretrained):
    model = tiny_llama(layers=LAYERS, seed=2)
    head = model.lm_head.weight.detach().clone()
    plan = ts.plan(model, ts.make_mesh({"data": 8}))
    drop = lambda n: None if n == "lm_head.weight" else n  # noqa: E731
    ts.load_safetensors(pretrained, model, plan, rename=drop, strict=False)
    state = ts.to_torch_state_dict(model)
    assert torch.equal(state["lm_head.weight"], head)
    assert torch.equal(state["model.norm.weight"], reference(pretrained).model.norm.weight.detach())
    meta = tiny_llama(layers=LAYERS, meta=True)
    with pytest.raises(ts.ShardingError, match=r"lm_head.weight \(128, 64\): on the meta device and not in the"):
        ts.load_safetensors(pretrained, meta, plan, rename=drop, strict=False)
    assert meta.lm_head.weight.device.type == "meta"  # nothing placed


@pytest.mark.slow
@pytest.mark.parametrize(
    ("axes", "rules", "options"),
    [
        ({"data": 8}, lambda m: presets.fsdp(min_size=256), {}),
        ({"data": 4, "model": 2}, presets.hf_rules, {}),
        ({"data": 4, "model": 2}, presets.hf_rules, {"scan_layers": True}),
        ({"stage": 2, "data": 2, "model": 2}, lambda m: presets.hf_rules(m, fsdp_min_size=1024),
         {"pipeline": ts.Pipeline(microbatches=4)}),
    ],
    ids=["fsdp", "fsdp_tp", "scan", "pipeline"],
)  # fmt: skip
def test_training_from_pretrained_matches_eager(pretrained, axes, rules, options):
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (8, 12), generator=g) for _ in range(4)]
    ref = reference(pretrained)
    expected = torch_losses(ref, lm_loss, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD), data)
    trainer = _trainer(tiny_llama(layers=LAYERS, seed=5), axes, rules, **options)
    _ = trainer.step(data[0])  # a trained state: the load must reset the optimizer and step
    ts.load_safetensors(pretrained, trainer)
    assert trainer.step_count == 0
    np.testing.assert_allclose([float(trainer.step(b)["loss"]) for b in data], expected, rtol=1e-4)


def test_a_scanned_stack_missing_a_layer_keeps_that_layers_values(pretrained):
    trainer = TARGETS["trainer_scan"]()
    name = "model.layers.2.mlp.up_proj.weight"
    own = ts.to_torch_state_dict(trainer)[name]
    ts.load_safetensors(pretrained, trainer, rename=lambda n: None if n == name else n, strict=False)
    state, expected = ts.to_torch_state_dict(trainer), reference(pretrained).state_dict()
    assert torch.equal(state.pop(name), own)
    assert_state_equal(state, {k: v for k, v in expected.items() if k != name})


def _logits(model: torch.nn.Module):
    """The model's logits as one jitted function of the input ids."""
    import torchax.interop

    params = dict(model.named_parameters()) | dict(model.named_buffers())
    forward = torchax.interop.jax_jit(lambda p, x: torch.func.functional_call(model, p, (x,)).logits)
    return lambda ids: forward(params, ids)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_a_meta_built_model_with_a_scaled_embedding_loads_and_runs_like_eager(tmp_path, model_type):
    """Gemma's embedding holds its parameter and a computed, non-persistent ``embed_scale``: computed, not read."""
    family = next(f for f in DENSE if f.model_type == model_type)
    source = build(family, seed=1).eval()
    source.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = build(family, seed=2)
    plan = ts.plan(model, ts.make_mesh(MESH_DM), presets.hf_rules(model))
    ts.load_safetensors(tmp_path, model, plan)
    for name, buffer in source.named_buffers():
        np.testing.assert_array_equal(np.asarray(model.get_buffer(name).jax()), buffer.numpy(), err_msg=name)
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = source(input_ids=ids).logits
    assert_close(_logits(model)(ts.shard_batch(ids, plan.mesh)), expected)
