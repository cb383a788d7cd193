"""Ready-made rule tables, asserted as exact shardings from tables of dotted names."""

import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard
from testsupport.models import MLP, Block
from torchshard import ShardingError, UnusedRuleWarning, presets


def _specs(model, mesh, rules):
    return {name: entry.spec for name, entry in torchshard.plan(model, mesh, rules).entries.items()}


def _assert_plan(model, mesh, rules, expected):
    plan = torchshard.plan(model, mesh, rules)
    assert set(plan) == set(expected)
    for name, spec in expected.items():
        assert plan[name] == NamedSharding(mesh, spec), (name, plan.spec(name), spec)


@pytest.mark.parametrize("rules", [presets.replicated(), presets.data_parallel()], ids=["replicated", "data_parallel"])
def test_everything_replicated(mesh_dm, rules):
    model = MLP()
    _assert_plan(model, mesh_dm, rules, {name: P() for name in model.state_dict()})


def _uneven():
    return nn.Sequential(nn.Linear(30, 8), nn.Linear(8, 36), nn.Linear(36, 2))


@pytest.mark.parametrize(
    ("mesh_name", "axis", "expected"),
    [
        (
            "mesh_dm",  # data=4
            "data",
            {
                "0.weight": P("data", None),  # [8, 30]: 30 is the larger dim but 4 does not divide it
                "0.bias": P(),  # 8 elements < min_size
                "1.weight": P("data", None),  # [36, 8]: the largest dim
                "1.bias": P("data"),
                "2.weight": P(None, "data"),  # [2, 36]
                "2.bias": P(),
            },
        ),
        (
            "mesh_fsdp",  # data=8
            "data",
            {
                "0.weight": P("data", None),
                "0.bias": P(),
                "1.weight": P(None, "data"),  # 36 is not divisible by 8, 8 is
                "1.bias": P(),  # nothing divisible: replicated
                "2.weight": P(),
                "2.bias": P(),
            },
        ),
        (
            "mesh_dm",  # data × model = 8
            ("data", "model"),
            {
                "0.weight": P(("data", "model"), None),
                "0.bias": P(),
                "1.weight": P(None, ("data", "model")),
                "1.bias": P(),
                "2.weight": P(),
                "2.bias": P(),
            },
        ),
    ],
)
def test_fsdp_largest_divisible_dim(request, mesh_name, axis, expected):
    mesh = request.getfixturevalue(mesh_name)
    _assert_plan(_uneven(), mesh, presets.fsdp(axis, min_size=16), expected)


@pytest.mark.parametrize(
    ("min_size", "expected"),
    [
        (2**12, {"0.weight": P(), "1.weight": P(), "1.bias": P()}),  # the default: these are all small
        (240, {"0.weight": P("data", None), "1.weight": P("data", None), "1.bias": P()}),
        (0, {"0.weight": P("data", None), "1.weight": P("data", None), "1.bias": P("data")}),
    ],
)
def test_fsdp_min_size(mesh_dm, min_size, expected):
    specs = _specs(_uneven(), mesh_dm, presets.fsdp(min_size=min_size))
    assert {name: specs[name] for name in expected} == expected


def test_fsdp_ties_on_the_first_of_equal_dims(mesh_dm):
    assert _specs(nn.Linear(8, 8, bias=False), mesh_dm, presets.fsdp(min_size=1)) == {"weight": P("data", None)}


@pytest.mark.parametrize("min_size", [-1, 1.5, "big"])
def test_fsdp_bad_min_size(min_size):
    with pytest.raises(ShardingError, match=r"(?s)invalid fsdp\(\) arguments.*min_size=.* must be an int ≥ 0"):
        presets.fsdp(min_size=min_size)


def test_fsdp_unknown_axis(mesh_dm):
    with pytest.raises(ShardingError, match=r"fsdp axis 'dta' is not an axis of Mesh\(data=4, model=2\); use one of"):
        torchshard.plan(MLP(), mesh_dm, presets.fsdp("dta", min_size=16))


BLOCK_TP = {
    "norm.weight": P(),
    "norm.bias": P(),
    "up.weight": P("model", None),  # Linear weight is [out, in]: colwise splits out
    "up.bias": P("model"),
    "down.weight": P(None, "model"),  # rowwise splits in
    "down.bias": P(),
}


def test_tensor_parallel_linear(mesh_dm):
    _assert_plan(Block(), mesh_dm, presets.tensor_parallel(colwise=["up"], rowwise=["down"]), BLOCK_TP)


def test_tensor_parallel_on_another_axis(mesh_dm):
    specs = _specs(Block(), mesh_dm, presets.tensor_parallel(colwise=["up"], rowwise=["down"], axis="data"))
    assert (specs["up.weight"], specs["up.bias"], specs["down.weight"]) == (P("data", None), P("data"), P(None, "data"))


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 64)


class WithConv1D(nn.Module):
    """transformers' GPT-2 Conv1D stores its weight as [in, out]."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c_fc = Conv1D(64, 32)  # nf=out, nx=in: weight [32, 64]
        self.c_proj = Conv1D(32, 64)


@pytest.mark.parametrize(
    ("model_fn", "colwise", "rowwise", "expected"),
    [
        (Embedder, ["tok"], [], {"tok.weight": P(None, "model")}),  # [num, dim]: colwise splits dim
        (Embedder, [], ["tok"], {"tok.weight": P("model", None)}),  # rowwise splits the vocabulary
        (
            WithConv1D,
            ["c_fc"],
            ["c_proj"],
            {
                "c_fc.weight": P(None, "model"),
                "c_fc.bias": P("model"),
                "c_proj.weight": P("model", None),
                "c_proj.bias": P(),
            },
        ),
    ],
    ids=["embedding-colwise", "embedding-rowwise", "conv1d"],
)
def test_tensor_parallel_layouts(mesh_dm, model_fn, colwise, rowwise, expected):
    specs = _specs(model_fn(), mesh_dm, presets.tensor_parallel(colwise=colwise, rowwise=rowwise))
    assert {name: specs[name] for name in expected} == expected


def test_tensor_parallel_patterns_name_modules(mesh_dm):
    rules = presets.tensor_parallel(colwise=[r"layers\.[02]"], rowwise=[r"layers\.1"])
    _assert_plan(
        MLP(),
        mesh_dm,
        rules,
        {
            "layers.0.weight": P("model", None),
            "layers.0.bias": P("model"),
            "layers.1.weight": P(None, "model"),
            "layers.1.bias": P(),
            "layers.2.weight": P("model", None),
            "layers.2.bias": P("model"),
        },
    )


def test_tensor_parallel_on_a_module_without_a_2d_weight(mesh_dm):
    with pytest.raises(ShardingError, match=r"norm\.weight \(32,\) spec P\(None, 'model'\).*has rank 1"):
        torchshard.plan(Block(), mesh_dm, presets.tensor_parallel(rowwise=["norm"]))


def test_tensor_parallel_bad_pattern():
    with pytest.raises(ShardingError, match=r"pattern 'up\(' is not a valid regex"):
        presets.tensor_parallel(colwise=["up("])


def test_tensor_parallel_unused_pattern_warns_once(mesh_dm):
    # the bias rule never warns: a bias-free Linear is not a typo
    with pytest.warns(
        UnusedRuleWarning, match=r"'\(\?:upp\)\(\?:\\\\.base_layer\)\?\\\\.weight' → colwise\('model'\).*closest names"
    ) as got:
        torchshard.plan(Block(), mesh_dm, presets.tensor_parallel(colwise=["upp"]))
    assert len(got) == 1


def test_tensor_parallel_bias_free_linear_does_not_warn(mesh_dm):
    specs = _specs(nn.Sequential(nn.Linear(8, 4, bias=False)), mesh_dm, presets.tensor_parallel(colwise=["0"]))
    assert specs == {"0.weight": P("model", None)}


FSDP_TP = {
    "norm.weight": P("data"),
    "norm.bias": P("data"),
    "up.weight": P("model", "data"),  # TP on out, FSDP on the largest remaining dim
    "up.bias": P("model"),  # already sharded on its only dim
    "down.weight": P("data", "model"),
    "down.bias": P("data"),
}


@pytest.mark.parametrize(
    "rules",
    [
        presets.tensor_parallel(colwise=["up"], rowwise=["down"]) + presets.fsdp(min_size=16),
        presets.fsdp(min_size=16) + presets.tensor_parallel(colwise=["up"], rowwise=["down"]),
    ],
    ids=["tp+fsdp", "fsdp+tp"],
)
def test_fsdp_and_tensor_parallel_compose(mesh_dm, rules):
    _assert_plan(Block(), mesh_dm, rules, FSDP_TP)


def test_fsdp_leaves_a_spec_that_already_uses_its_axis(mesh_dm):
    rules = torchshard.Rules([(r"up\.weight", (None, "data"))]) + presets.fsdp(min_size=16)
    assert _specs(Block(), mesh_dm, rules)["up.weight"] == P(None, "data")


def test_fsdp_with_a_spec_longer_than_the_rank(mesh_dm):
    rules = torchshard.Rules([(r"up\.weight", ("model", None, None))]) + presets.fsdp(min_size=16)
    with pytest.raises(ShardingError, match=r"up\.weight \(64, 32\) spec .*: spec has 3 entries but .* rank 2"):
        torchshard.plan(Block(), mesh_dm, rules)


# --- HF tp_plans --------------------------------------------------------------------------------


class HFAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))


class HFMLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim)
        self.down_proj = nn.Linear(2 * dim, dim)


class HFLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.self_attn, self.mlp = HFAttention(dim), HFMLP(dim)


class HFModel(nn.Module):
    def __init__(self, vocab=64, dim=16, depth=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(HFLayer(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)


class HFCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = HFModel()
        self.lm_head = nn.Linear(16, 64, bias=False)


HF_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise_rep",
    "layers.*.mlp.down_proj": "rowwise_rep",
    "embed_tokens": "embedding_rowwise",
    "lm_head": "colwise_gather_output",
    "norm": "sequence_parallel",
}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.0.self_attn.q_proj.weight", P("model", None)),
        ("model.layers.1.self_attn.q_proj.weight", P("model", None)),
        ("model.layers.1.self_attn.o_proj.weight", P(None, "model")),
        ("model.layers.0.self_attn.k_proj.weight", P()),
        ("model.layers.0.mlp.gate_proj.weight", P("model", None)),
        ("model.layers.0.mlp.gate_proj.bias", P("model")),
        ("model.layers.1.mlp.down_proj.weight", P(None, "model")),
        ("model.layers.1.mlp.down_proj.bias", P()),
        ("model.layers.0.mlp.up_proj.weight", P()),
        ("model.embed_tokens.weight", P("model", None)),
        ("lm_head.weight", P("model", None)),
        ("model.norm.weight", P()),
    ],
)
def test_from_hf_tp_plan(mesh_dm, name, expected):
    plan = torchshard.plan(HFCausalLM(), mesh_dm, presets.from_hf_tp_plan(HF_PLAN))
    assert plan[name] == NamedSharding(mesh_dm, expected)


def test_from_hf_tp_plan_star_is_a_layer_index(mesh_dm):
    rules = presets.from_hf_tp_plan({"layers.*.self_attn.q_proj": "colwise"})
    assert rules.spec_for("model.layers.12.self_attn.q_proj.weight") is not None
    assert rules.spec_for("model.layers.x.self_attn.q_proj.weight") is None
    assert rules.spec_for("model.layers.0.self_attn.q_proj_extra.weight") is None
    assert rules.spec_for("layers.0.self_attn.q_proj.weight") is not None  # relative to the base model


def test_from_hf_tp_plan_unsupported_styles_listed_together():
    tp_plan = {
        "layers.*.mlp.gate_up_proj": "opaque_custom",
        "layers.*.mlp.experts": "grouped_gemm",  # an ep_plan style, not a tp one
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    }
    with pytest.raises(ShardingError, match=r"unsupported HF tp_plan styles \(2 problems\)") as err:
        presets.from_hf_tp_plan(tp_plan)
    message = str(err.value)
    assert "'layers.*.mlp.gate_up_proj': tp style 'opaque_custom' has no torchshard layout" in message
    assert "'layers.*.mlp.experts': tp style 'grouped_gemm'" in message
    assert "pass replicate_unsupported=True" in message
    rules = presets.from_hf_tp_plan(tp_plan, replicate_unsupported=True)
    # per entry: the module's (or its peft base layer's) weight and bias, or the bare parameter; then LoRA factors
    heads = [r"(?:.*\.)?layers\.\d+\.self_attn\.q_proj", r"(?:.*\.)?layers\.\d+\.mlp\.experts\.gate_up_proj"]
    assert [r.pattern for r in rules][::3] == [h + r"(?:(?:\.base_layer)?(?:\.weight|\.bias))?" for h in heads]
    assert [r.source for r in rules][:3] == ["tp:colwise", "tp:colwise (LoRA)", "tp:colwise (LoRA, replicated)"]


def test_from_hf_tp_plan_of_a_real_llama(mesh_dm):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tp_plan = model._tp_plan or {"model." + k: v for k, v in config.base_model_tp_plan.items()}
    specs = _specs(model, mesh_dm, presets.from_hf_tp_plan(tp_plan))
    for i in range(2):
        head = f"model.layers.{i}."
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert specs[head + proj + ".weight"] == P("model", None), proj
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            assert specs[head + proj + ".weight"] == P(None, "model"), proj
        assert specs[head + "input_layernorm.weight"] == P()
