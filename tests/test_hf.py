"""Hugging Face transformers models: real tp_plans and names, head-count validation, ties, buffers, training parity."""

from __future__ import annotations

import copy
import re

import jax
import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P
from packaging.version import Version

import torchshard as ts
from testsupport.helpers import assert_close, torch_losses
from torchshard import ShardingError, presets
from torchshard._bridge.env import env

transformers = pytest.importorskip("transformers")
# transformers 5.21 put the input embeddings in a model's own tp_plan (embedding_rowwise); before, TP left them out
PLANS_EMBEDDINGS = Version(transformers.__version__) >= Version("5.21")
OWN_EMBEDDINGS_PLAN = "transformers < 5.21 leaves the input embeddings out of a model's own tp_plan"

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA
    "intermediate_size": 128,
    "vocab_size": 128,
}
BATCH = 8
# AdamW set explicitly on both sides: optax.adamw's default weight_decay is 1e-4, torch's 1e-2
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


def llama(*, meta: bool = False, seed: int = 0, **overrides) -> torch.nn.Module:
    config = transformers.LlamaConfig(**(SMALL | overrides))
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return transformers.LlamaForCausalLM(config)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("model.layers.0.self_attn.q_proj.weight", P("model", None)),
        ("model.layers.0.self_attn.q_proj.bias", P("model")),
        ("model.layers.1.self_attn.k_proj.weight", P("model", None)),
        ("model.layers.1.self_attn.v_proj.bias", P("model")),
        ("model.layers.0.self_attn.o_proj.weight", P(None, "model")),
        ("model.layers.0.self_attn.o_proj.bias", P()),
        ("model.layers.1.mlp.gate_proj.bias", P("model")),
        ("model.layers.1.mlp.up_proj.weight", P("model", None)),
        ("model.layers.1.mlp.down_proj.weight", P(None, "model")),
        ("model.layers.1.mlp.down_proj.bias", P()),
        ("model.layers.0.input_layernorm.weight", P()),
        ("model.embed_tokens.weight", P()),  # not in base_model_tp_plan
        ("model.rotary_emb.inv_freq", P()),  # a non-persistent buffer is planned too
    ],
)
def test_base_model_tp_plan_on_real_state_dict_names(mesh_dm, name, spec):
    model = llama(meta=True, attention_bias=True, mlp_bias=True)
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()
    plan = ts.plan(model, mesh_dm, presets.from_hf_tp_plan(model.config.base_model_tp_plan))
    assert plan.spec(name) == spec


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        # embedding_rowwise / colwise_gather_output: vocabulary over model, and FSDP on it too
        ("model.embed_tokens.weight", P(("model", "data"), None)),
        ("lm_head.weight", P(("model", "data"), None)),
        ("model.layers.0.self_attn.q_proj.weight", P("model", "data")),
        ("model.layers.0.mlp.down_proj.weight", P("data", "model")),
        ("model.norm.weight", P()),  # below fsdp_min_size
    ],
)
@pytest.mark.parametrize("tied", [False, True])
def test_hf_rules_use_the_models_own_plan_and_fsdp(mesh_dm, name, spec, tied):
    if name == "model.embed_tokens.weight" and not tied and not PLANS_EMBEDDINGS:
        pytest.skip(OWN_EMBEDDINGS_PLAN)
    model = llama(meta=True, tie_word_embeddings=tied)
    plan = ts.plan(model, mesh_dm, presets.hf_rules(model, fsdp_min_size=1024))
    assert plan.spec(name) == spec
    assert (plan.entries["lm_head.weight"].tied_to == "model.embed_tokens.weight") is tied


@pytest.mark.parametrize(
    ("vocab", "spec"),
    [
        (128, P(("model", "data"), None)),
        (132, P("model", "data")),  # 132 rows do not split 8 ways: FSDP falls back to the hidden dim
    ],
)
@pytest.mark.skipif(not PLANS_EMBEDDINGS, reason=OWN_EMBEDDINGS_PLAN)
def test_fsdp_shards_the_vocabulary_dim_of_embeddings(mesh_dm, vocab, spec):
    model = llama(meta=True, vocab_size=vocab)
    plan = ts.plan(model, mesh_dm, presets.hf_rules(model, fsdp_min_size=1024))
    assert plan.spec("model.embed_tokens.weight") == plan.spec("lm_head.weight") == spec


def test_hf_rules_without_fsdp(mesh_dm):
    model = llama(meta=True)
    plan = ts.plan(model, mesh_dm, presets.hf_rules(model, fsdp_axis=None))
    assert plan.spec("model.layers.0.self_attn.q_proj.weight") == P("model", None)


def test_unexpressible_styles_are_named():
    tp_plan = transformers.LlamaConfig().base_model_tp_plan | {"layers.*.mlp.experts": "opaque_custom"}
    with pytest.raises(ShardingError, match=r"'layers\.\*\.mlp\.experts': tp style 'opaque_custom' has no"):
        presets.from_hf_tp_plan(tp_plan)
    rules = presets.from_hf_tp_plan(tp_plan, replicate_unsupported=True)
    assert rules.spec_for("model.layers.0.mlp.experts.weight") is None


@pytest.mark.parametrize(
    ("heads", "kv_heads", "mesh_axes", "problems"),
    [
        (4, 2, {"data": 4, "model": 2}, []),
        (4, 4, {"data": 2, "model": 4}, []),
        (4, 2, {"data": 2, "model": 4}, ["config.num_key_value_heads=2 .* axis size 4 .* in \\[1, 2\\]"]),
        (
            4,
            4,
            {"data": 1, "model": 8},
            [
                "config.num_attention_heads=4 is not divisible by the 'model' axis size 8 .*in \\[1, 2, 4\\]",
                "config.num_key_value_heads=4 is not divisible",
            ],
        ),
        (4, 2, {"data": 8}, []),  # no 'model' axis: the TP rules report it, not this check
    ],
)
def test_validate_hf_config(heads, kv_heads, mesh_axes, problems):
    config = transformers.LlamaConfig(**(SMALL | {"num_attention_heads": heads, "num_key_value_heads": kv_heads}))
    mesh = ts.make_mesh(mesh_axes)
    if not problems:
        presets.validate_hf_config(config, mesh)
        return
    with pytest.raises(ShardingError, match=r"LlamaConfig cannot be tensor-parallel over 'model'") as err:
        presets.validate_hf_config(config, mesh)
    assert len(err.value.problems) == len(problems)
    for pattern, problem in zip(problems, err.value.problems, strict=True):
        assert re.search(pattern, problem), problem


@pytest.mark.skipif(not hasattr(transformers, "Dots3NoteTextConfig"), reason="Dots3-Note is new in transformers 5.23")
def test_a_config_whose_layers_differ_is_checked_layer_by_layer():
    # Dots3-Note keeps heads per layer (128 or 64): a global read is transformers' AmbiguousGlobalPerLayerAttributeError
    from tools.tiny import tiny_kwargs

    kw = tiny_kwargs(transformers.Dots3NoteTextConfig())
    sliding = kw["per_layer_config"][1] | {"num_attention_heads": 6, "num_key_value_heads": 6}
    dots = transformers.Dots3NoteTextConfig(**(kw | {"per_layer_config": {1: sliding}}))  # layers of 4 and 6 heads
    presets.validate_hf_config(dots, ts.make_mesh({"data": 4, "model": 2}))
    with pytest.raises(ShardingError, match=r"Dots3NoteTextConfig cannot be tensor-parallel .* \(2 problems\)") as err:
        presets.validate_hf_config(dots, ts.make_mesh({"data": 2, "model": 4}))
    assert [p.split(" of ")[0] for p in err.value.problems] == [
        "config.per_layer_config[1].num_attention_heads=6 is not divisible by the 'model' axis size 4",
        "config.per_layer_config[1].num_key_value_heads=6 is not divisible by the 'model' axis size 4",
    ]


def test_plan_reports_head_counts_with_every_other_problem():
    model = llama(meta=True, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=102)
    mesh = ts.make_mesh({"data": 2, "model": 4})
    with pytest.raises(ShardingError, match=r"invalid sharding plan") as err:
        ts.plan(model, mesh, presets.hf_rules(model))
    text = str(err.value)
    assert "config.num_key_value_heads=2 is not divisible by the 'model' axis size 4" in text
    assert "use a 'model' axis size in [1, 2]" in text
    assert "mlp.up_proj.weight (102, 64)" in text  # the weights' own divisibility, in the same error


class NoPlanModel(torch.nn.Linear):
    """A module with a config but no tensor-parallel plan (like many non-LLM transformers models)."""

    def __init__(self):
        super().__init__(2, 2)
        self.config = transformers.PretrainedConfig()


@pytest.mark.parametrize(
    ("model_fn", "match"),
    [
        (lambda: torch.nn.Linear(2, 2), r"hf_rules\(\) needs a transformers model \(with \.config\), got Linear"),
        (NoPlanModel, r"NoPlanModel has no tensor-parallel plan .*; write tensor_parallel\(colwise="),
    ],
)
def test_hf_rules_errors(model_fn, match):
    with pytest.raises(ShardingError, match=match):
        presets.hf_rules(model_fn())


def batches(n, *, batch=BATCH, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=g) for _ in range(n)]


def eager_losses(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return torch_losses(model, lm_loss, opt, data)


def sharded_logits(model, ids, mesh):
    with env(), jax.set_mesh(mesh):
        return model(input_ids=ts.shard_batch(ids, mesh)).logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.slow
def test_llama_trains_like_torch(mesh_dm, tied):
    ref = llama(tie_word_embeddings=tied)
    model = copy.deepcopy(ref)
    plan = ts.plan(model, mesh_dm, presets.hf_rules(model, fsdp_min_size=1024))
    trainer = ts.Trainer(
        model, lm_loss, optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY), plan
    )
    assert (trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight) is tied
    buffer = trainer.model.model.rotary_emb.inv_freq
    assert buffer.jax().sharding == plan["model.rotary_emb.inv_freq"]

    data = batches(5)
    got = [float(trainer.step(ids)["loss"]) for ids in data]
    np.testing.assert_allclose(got, eager_losses(ref, data), rtol=1e-4)
    assert (trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight) is tied

    # attention runs on this device's rows only: had FSDP put "data" on the embedding's hidden dim, the
    # lookup's output would carry it and GSPMD would hand the whole batch to every device. Attention
    # keeps its heads split over "model": nothing is gathered over "model" (torchax's own attention did).
    stats = ts.inspect.collectives(trainer, data[0])
    attention = [shape for op in stats.ops for shape in op.shapes if shape.count(",") >= 3]  # 4-d and up
    assert all(s.startswith(f"f32[{BATCH // 4},") for s in attention), f"{attention}\n{stats}"
    assert stats.count("all-gather", axes="model") == 0, stats

    ids = batches(1, seed=2)[0]
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    assert_close(sharded_logits(trainer.model, ids, mesh_dm), expected, tol=1e-4, what="logits after training")


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64")  # M2M100's position ids
def test_layerdrop_is_named_instead_of_frozen_at_trace_time(mesh_fsdp):
    """M2M100 skips layers on ``torch.rand([]) < p``: inside the step that draw is traced, so it cannot steer Python."""
    config = transformers.M2M100Config(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        encoder_layerdrop=0.5, decoder_layerdrop=0.5, dropout=0.0,
    )  # fmt: skip
    model = transformers.M2M100ForConditionalGeneration(config)
    trainer = ts.Trainer(model, lm_loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp))
    match = r"loss_fn: M2M100Encoder 'model\.encoder' turns a traced tensor into a Python value .*set layerdrop=0"
    with pytest.raises(ShardingError, match=match):
        trainer.step(torch.randint(3, 64, (8, 8)))
