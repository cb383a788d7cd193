"""transformers tp_plan / ep_plan styles as rules: stacked expert weights, expert parallelism, entries that miss."""

from __future__ import annotations

import math
import re

import jax
import pytest
import torch
from jax.sharding import PartitionSpec as P

import torchshard as ts
from torchshard import ShardingError, UnusedRuleWarning, presets

transformers = pytest.importorskip("transformers")

MIXTRAL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
EXPERTS = "model.layers.1.mlp.experts"


# Mixtral's expert styles as transformers 5.17-5.24 plan them; 5.25 leaves the experts out of its tp_plan (its
# moe_tp_experts style is deprecated for expert parallelism), so they are given here to test how they split
EXPERT_TP = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}


def mixtral() -> torch.nn.Module:
    config = transformers.MixtralConfig(**MIXTRAL)
    config.base_model_tp_plan = config.base_model_tp_plan | EXPERT_TP
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize(
    ("axes", "kwargs", "gate_up", "down"),
    [
        # packed_colwise splits the packed [experts, 2·inter, hidden] output dim, rowwise the input dim
        ({"data": 4, "model": 2}, {}, P(None, "model", "data"), P(None, "data", "model")),
        ({"data": 4, "model": 2}, {"fsdp_axis": None}, P(None, "model", None), P(None, None, "model")),
        ({"expert": 4, "model": 2}, {"expert_axis": "expert", "fsdp_axis": None},
         P("expert", "model", None), P("expert", None, "model")),
        ({"data": 2, "expert": 4}, {"axis": None, "expert_axis": "expert"},
         P("expert", "data", None), P("expert", None, "data")),
        # expert parallelism over the data axis itself: FSDP then leaves the experts alone
        ({"data": 4, "model": 2}, {"axis": None, "expert_axis": "data"}, P("data", None, None), P("data", None, None)),
    ],
    ids=["tp+fsdp", "tp", "ep+tp", "ep+fsdp", "ep-over-data"],
)  # fmt: skip
def test_stacked_expert_weights(axes, kwargs, gate_up, down):
    model = mixtral()
    plan = ts.plan(model, ts.make_mesh(axes), presets.hf_rules(model, fsdp_min_size=1024, **kwargs))
    assert (plan.spec(f"{EXPERTS}.gate_up_proj"), plan.spec(f"{EXPERTS}.down_proj")) == (gate_up, down)


def test_axis_none_adds_no_tensor_parallel_rule():
    model = mixtral()
    plan = ts.plan(model, ts.make_mesh({"data": 8}), presets.hf_rules(model, axis=None, fsdp_min_size=1024))
    assert plan.spec("model.layers.0.self_attn.q_proj.weight") == P("data", None)
    assert all("model" not in str(plan.spec(n)) for n in plan.entries)


def test_a_mesh_without_the_tensor_parallel_axis_is_a_sharding_error():
    model = mixtral()
    with pytest.raises(ShardingError, match=r"q_proj\.weight .* on Mesh\(data=8\): unknown mesh axis 'model'"):
        ts.plan(model, ts.make_mesh({"data": 8}), presets.hf_rules(model))


class Custom(torch.nn.Module):
    """A model with a config and its own tp_plan, as transformers' remote-code models have."""

    def __init__(self, tp_plan: dict[str, str]):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.tp_plan = tp_plan
        self.proj = torch.nn.Linear(16, 32)
        self.scaler = torch.nn.Module()
        self.scaler.gain = torch.nn.Parameter(torch.ones(32))


def test_an_entry_on_a_module_without_weight_or_bias_is_an_error():
    match = (r"tp_plan entry 'scaler' \(colwise\) names module 'scaler' \(Module\), which holds \['gain'\] under it "
             r"but no weight or bias of its own \(nor a peft base_layer's\) to lay out")  # fmt: skip
    with pytest.raises(ShardingError, match=match):
        presets.hf_rules(Custom({"proj": "colwise", "scaler": "colwise"}))


def test_entries_for_modules_the_config_leaves_out_warn_once_and_add_no_rule():
    model = Custom({"proj": "colwise", "layers.*.mlp.gate_proj": "colwise", "q_proj": "rowwise"})
    with pytest.warns(UnusedRuleWarning, match=r"Custom's tp_plan entries \{'layers\.\*\.mlp\.gate_proj': 'colwise', "
                                               r"'q_proj': 'rowwise'\} match no module"):  # fmt: skip
        rules = presets.hf_rules(model, fsdp_axis=None)
    peft = ["tp:colwise (LoRA)", "tp:colwise (LoRA, replicated)"]
    assert [r.source for r in rules] == ["tp:colwise", *peft]
    assert ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), rules).spec("proj.weight") == P("model", None)


def test_expert_axis_on_a_dense_model_is_an_error():
    model = Custom({"proj": "colwise"})
    with pytest.raises(ShardingError, match=r"hf_rules\(expert_axis='expert'\): Custom has no stacked expert weights"):
        presets.hf_rules(model, expert_axis="expert")


def moe() -> torch.nn.Module:
    model = torch.nn.Module()
    model.w_in = torch.nn.Parameter(torch.ones(6, 32, 16))
    model.w_out = torch.nn.Parameter(torch.ones(6, 16, 32))
    return model


@pytest.mark.parametrize(
    ("patterns", "axes", "specs"),
    [
        ([r"w_in", r"w_out"], {"expert": 2, "data": 4}, (P("expert", None, None), P("expert", None, None))),
        (r"w_.*", {"expert": 3}, (P("expert", None, None), P("expert", None, None))),
        ([r"w_in"], {"expert": 2}, (P("expert", None, None), P())),
    ],
)
def test_expert_parallel(patterns, axes, specs):
    mesh = ts.make_mesh(axes, devices=jax.devices()[: math.prod(axes.values())])
    plan = ts.plan(moe(), mesh, presets.expert_parallel(patterns))
    assert (plan.spec("w_in"), plan.spec("w_out")) == specs


def test_expert_parallel_reports_every_problem_at_once():
    mesh = ts.make_mesh({"expert": 4, "data": 2})
    rules = presets.expert_parallel([r"w_in", r"w_gate"]) + presets.expert_parallel("w_out", axis="experts")
    with pytest.raises(ShardingError) as caught:
        ts.plan(moe(), mesh, rules)
    expected = [
        r"expert_parallel axis 'experts' is not an axis of Mesh\(expert=4, data=2\); use one of \['expert', 'data'\]",
        r"w_in \(6, 32, 16\) spec P\('expert', None, None\) on Mesh\(expert=4, data=2\): dim 0 \(size 6\) is not",
        r"expert_parallel pattern 'w_gate' matches no tensor of the model \(closest names: \['w_out', 'w_in'\]\)",
    ]
    for pattern in expected:
        assert any(re.match(pattern, p) for p in caught.value.problems), (pattern, caught.value.problems)
