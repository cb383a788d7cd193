"""All-to-all expert dispatch: tokens travel to their experts' devices and back, and train like eager torch.

The truth is the same model run unsharded in eager torch (AdamW losses rtol 1e-4, as the family table).
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import subprocess
import sys
import warnings

import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard as ts
from testsupport.helpers import torch_losses
from testsupport.models import Experts, MoE
from testsupport.models import MoEStack as Model
from torchshard import ArgumentError, ShardingError, presets

RTOL = 1e-4
EXPERTS, TOP_K, DIM = Experts.count, MoE.top_k, Experts.dim
AXES = {"data": 2, "expert": 4}
BATCH_SPEC = P(("data", "expert"))


class ScoredExperts(Experts):
    """GPT-OSS's experts before transformers 5: other argument names, the router's scores over every expert."""

    def forward(self, tokens, router_indices, routing_weights):  # [T, H], [T, k], [T, experts]
        out = torch.zeros_like(tokens)
        for e in range(self.num_experts):
            weight = routing_weights[:, e : e + 1] * (router_indices == e).any(-1, keepdim=True)
            out = out + weight * (torch.relu(tokens @ self.up[e].T) @ self.down[e].T)
        return out


class ScoredMoE(MoE):
    """GPT-OSS's router (a softmax over the top-k logits) with its weights scattered over every expert, [T, experts]."""

    def __init__(self):
        super().__init__()
        self.experts = ScoredExperts()

    def forward(self, x):
        flat = x.reshape(-1, DIM)
        logits, index = torch.topk(self.router(flat), TOP_K, dim=-1)
        scores = flat.new_zeros(flat.shape[0], EXPERTS).scatter(1, index, torch.softmax(logits, -1))
        return x + self.experts(flat, index, scores).reshape(x.shape)


class BatchedExperts(Experts):
    """Called with [B, S, H] hidden states and [B, S, k] choices: three arguments, but not the rows dispatch moves."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        rows = super().forward(*(t.flatten(0, 1) for t in (hidden_states, top_k_index, top_k_weights)))
        return rows.reshape(hidden_states.shape)


class BatchedMoE(MoE):
    # the router softmaxes its top-k logits (GPT-OSS's): with this init a softmax over all experts,
    # renormalised over the top-k, leaves router gradients of ~1e-8 whose rounding AdamW's first
    # step turns into 0.5% loss differences (under GSPMD and all-to-all alike)
    def __init__(self):
        super().__init__()
        self.experts = BatchedExperts()

    def forward(self, x):
        logits, index = torch.topk(self.router(x), TOP_K, dim=-1)
        return x + self.experts(x, index, torch.softmax(logits, -1))


class GroupedExperts(Experts):
    """Takes rows already grouped by expert (llama4's experts): no router's choice to move tokens by."""

    def forward(self, hidden_states):  # [experts · rows, H]
        grouped = hidden_states.reshape(EXPERTS, -1, DIM)
        return (torch.relu(grouped @ self.up.transpose(1, 2)) @ self.down.transpose(1, 2)).flatten(0, 1)


def mse(model, batch):
    x, y = batch
    return (model(x) - y).square().mean()


def _model(seed: int = 0, moe: type[MoE] = MoE) -> Model:
    torch.manual_seed(seed)
    return Model(moe=moe)


def _batches(steps: int = 4, rows: int = 16, seq: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, seq, DIM, generator=g), torch.randn(rows, seq, DIM, generator=g)) for _ in range(steps)]


def _trainer(model, **kwargs) -> ts.Trainer:
    rules = presets.expert_parallel([r".*experts\.(up|down)"], "expert")
    plan = ts.plan(model, ts.make_mesh(AXES), rules)
    kwargs.setdefault("batch_spec", BATCH_SPEC)
    return ts.Trainer(model, mse, optax.adamw(1e-2), plan, **kwargs)


@pytest.fixture(scope="module")
def eager():
    ref = _model()
    return torch_losses(ref, mse, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=1e-4), _batches())


def _losses(trainer: ts.Trainer, batches) -> tuple[list[float], list[dict]]:
    metrics = [{k: float(v) for k, v in trainer.step(b).items()} for b in batches]
    return [m["loss"] for m in metrics], metrics


@pytest.fixture(scope="module")
def dispatched():
    trainer = _trainer(_model(), expert_dispatch=None)  # the default where the plan shards experts
    return trainer, _losses(trainer, _batches())


def test_default_is_all_to_all_and_trains_like_eager_torch(dispatched, eager):
    trainer, (losses, metrics) = dispatched
    assert trainer.strategies["expert_dispatch"].option == ts.ExpertDispatch("all_to_all")
    np.testing.assert_allclose(losses, eager, rtol=RTOL)
    assert "dropped_tokens" not in metrics[0]  # dropless: nothing to report


def test_the_step_moves_tokens_by_all_to_all_over_the_expert_axis(dispatched):
    trainer, _ = dispatched
    stats = ts.inspect.collectives(trainer, _batches(1)[0])
    # per layer: tokens, expert ids and used flags out, results back; the backward pass the same way
    assert stats.count("all-to-all", axes="expert") >= 2 * 4, str(stats)


@pytest.mark.slow
def test_gspmd_keeps_the_plan_alone_and_trains_the_same(eager):
    trainer = _trainer(_model(), expert_dispatch=ts.ExpertDispatch("gspmd"))
    losses, _ = _losses(trainer, _batches())
    np.testing.assert_allclose(losses, eager, rtol=RTOL)
    assert ts.inspect.collectives(trainer, _batches(1)[0]).count("all-to-all", axes="expert") == 0


def _overloaded() -> Model:
    """Every token's first choice is expert 0 (its router bias dwarfs the logits)."""
    model = _model()
    with torch.no_grad():
        for layer in model.layers:
            layer.router.bias.zero_()
            layer.router.bias[0] = 50.0
    return model


@pytest.mark.slow
def test_a_capacity_drops_pairs_over_it_and_reports_them():
    batches = _batches(2)
    capped = _trainer(_overloaded(), expert_dispatch=ts.ExpertDispatch(capacity_factor=1.0))
    _, metrics = _losses(capped, batches)
    # 64 pairs per layer per expert device... 16 tokens per device choose expert 0 first; a cap of
    # ceil(1.0 * 16 * 2 / 8) = 4 rows per expert lets 8 through to device 0 from each device
    assert all(m["dropped_tokens"] > 0 for m in metrics), metrics
    roomy = _trainer(_overloaded(), expert_dispatch=ts.ExpertDispatch(capacity_factor=float(EXPERTS)))
    roomy_losses, roomy_metrics = _losses(roomy, batches)
    assert all(m["dropped_tokens"] == 0 for m in roomy_metrics)
    ref = _overloaded()
    expected = torch_losses(ref, mse, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=1e-4), batches)
    np.testing.assert_allclose(roomy_losses, expected, rtol=RTOL)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "ragged"}, r"kind='ragged' must be one of \['all_to_all', 'gspmd'\]"),
        ({"capacity_factor": 0}, r"capacity_factor=0 must be None \(dropless\) or a finite number > 0"),
        ({"capacity_factor": -1.5}, r"capacity_factor=-1.5 must be"),
        ({"capacity_factor": float("inf")}, r"capacity_factor=inf must be"),
        ({"capacity_factor": float("nan")}, r"capacity_factor=nan must be"),
        ({"capacity_factor": "2"}, r"capacity_factor='2' must be"),
    ],
)
def test_bad_arguments_are_argument_errors(kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        ts.ExpertDispatch(**kwargs)


def test_all_to_all_needs_the_batch_split_over_the_expert_axis():
    with pytest.raises(
        ShardingError, match=r"layers\.0\.experts: the batch is not split over the expert axis 'expert'"
    ):
        _trainer(_model(), batch_spec=P("data"), expert_dispatch=ts.ExpertDispatch())


def test_all_to_all_needs_experts_the_plan_shards():
    model = _model()
    plan = ts.plan(model, ts.make_mesh(AXES), presets.fsdp(min_size=1))
    with pytest.raises(ShardingError, match=r"no experts module to dispatch to"):
        ts.Trainer(model, mse, optax.adamw(1e-2), plan, batch_spec=BATCH_SPEC, expert_dispatch=ts.ExpertDispatch())


@pytest.mark.slow
def test_the_default_falls_back_to_the_plan_where_all_to_all_cannot_run_and_says_so_once(eager):
    with pytest.warns(ts.ExpertDispatchWarning) as caught:
        trainer = _trainer(_model(), batch_spec=P("data"))
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "keeps the plan's sharding (GSPMD, no all-to-all)" in message
    for layer in ("layers.0.experts", "layers.1.experts"):
        assert f"{layer}: the batch is not split over the expert axis 'expert'" in message
    assert trainer.strategies["expert_dispatch"].option is None
    losses, _ = _losses(trainer, _batches())
    np.testing.assert_allclose(losses, eager, rtol=RTOL)


def test_a_trainer_refuses_something_else():
    with pytest.raises(ArgumentError, match=r"expert_dispatch must be an ExpertDispatch\(...\) or None, got str"):
        _trainer(_model(), expert_dispatch="all_to_all")


def test_the_swapped_forward_is_gone_after_the_trace(dispatched):
    trainer, _ = dispatched
    assert all("forward" not in layer.experts.__dict__ for layer in trainer.model.layers)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_logits_and_the_aux_loss_train_like_torch_under_all_to_all(family):
    """output_router_logits=True: the router is the model's own, so its logits and aux loss are unchanged."""
    from tools.families import build, loss_and_aux, with_router_logits

    reference = build(with_router_logits(family))
    model = copy.deepcopy(reference)
    loss_fn = loss_and_aux

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (8, 16), generator=g) for _ in range(3)]
    rules = presets.hf_rules(model, axis=None, expert_axis="expert", fsdp_min_size=1024)
    trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), ts.plan(model, ts.make_mesh(AXES), rules),
                         batch_spec=BATCH_SPEC, scan_layers=True)  # fmt: skip
    assert trainer.strategies["expert_dispatch"].option == ts.ExpertDispatch("all_to_all")
    got = [trainer.step(b) for b in data]
    expected = torch_losses(reference, lambda m, ids: loss_fn(m, ids)[0],
                            torch.optim.SGD(reference.parameters(), lr=0.1), data)  # fmt: skip
    np.testing.assert_allclose([float(m["loss"]) for m in got], expected, rtol=RTOL)
    assert float(got[0]["aux_loss"]) > 0.1


@pytest.mark.slow
def test_experts_are_recognised_by_their_arguments_meaning_not_names_and_dense_scores_train_like_torch():
    """GPT-OSS's old interface: (tokens, router_indices, routing_weights [T, experts])."""
    trainer = _trainer(_model(moe=ScoredMoE))
    assert trainer.strategies["expert_dispatch"].option == ts.ExpertDispatch("all_to_all")
    losses, _ = _losses(trainer, _batches())
    ref = _model(moe=ScoredMoE)
    expected = torch_losses(ref, mse, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=1e-4), _batches())
    np.testing.assert_allclose(losses, expected, rtol=RTOL)
    assert ts.inspect.collectives(trainer, _batches(1)[0]).count("all-to-all", axes="expert") >= 2 * 4


@pytest.mark.slow
def test_a_call_that_is_not_the_routing_rows_keeps_the_plan_and_says_so_once_per_module():
    trainer = _trainer(_model(moe=BatchedMoE))
    assert trainer.strategies["expert_dispatch"].option == ts.ExpertDispatch(
        "all_to_all"
    )  # the signature fits; the call does not
    batches = _batches()
    with pytest.warns(ts.ExpertDispatchWarning) as caught:
        losses, _ = _losses(trainer, batches)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert re.search(r"layers\.0\.experts: called with \(float32\[16, 4, 16\], int\d+\[16, 4, 2\], "
                     r"float32\[16, 4, 2\]\), not \(hidden states \[T, H\]", str(caught[0].message))  # fmt: skip
    assert "layers.1.experts: called with" in str(caught[0].message)
    ref = _model(moe=BatchedMoE)
    expected = torch_losses(ref, mse, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=1e-4), batches)
    np.testing.assert_allclose(losses, expected, rtol=RTOL)


def test_asking_for_all_to_all_with_a_call_that_is_not_the_routing_rows_is_an_error():
    trainer = _trainer(_model(moe=BatchedMoE), expert_dispatch=ts.ExpertDispatch())
    with pytest.raises(ShardingError, match=r"cannot move this experts module's tokens:[\s\S]*layers\.0\.experts: "
                                            r"called with \(float32\[16, 4, 16\]"):  # fmt: skip
        trainer.step(_batches(1)[0])


def _grouped() -> Model:
    model = _model()
    for layer in model.layers:
        layer.experts = GroupedExperts()
    return model


def test_experts_that_take_no_routing_keep_the_plan_and_say_why():
    with pytest.warns(ts.ExpertDispatchWarning) as caught:
        trainer = _trainer(_grouped())
    assert len(caught) == 1
    assert re.search(r"layers\.0\.experts: its experts are sharded over 'expert', but GroupedExperts\.forward"
                     r"\(hidden_states\) does not take \(hidden states \[T, H\], expert indices \[T, k\]",
                     str(caught[0].message))  # fmt: skip
    assert trainer.strategies["expert_dispatch"].option is None
    with pytest.raises(ShardingError, match=r"GroupedExperts\.forward\(hidden_states\) does not take[\s\S]*"
                                            r"no experts module to dispatch to"):  # fmt: skip
        _trainer(_grouped(), expert_dispatch=ts.ExpertDispatch())


def test_choosing_gspmd_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            _trainer(_grouped(), expert_dispatch=ts.ExpertDispatch("gspmd")).strategies["expert_dispatch"].option.kind
            == "gspmd"
        )


def _gpt_oss(seed: int = 0) -> nn.Module:
    """A tiny transformers GPT-OSS: experts called as (hidden_states, router_indices, routing_weights)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, vocab_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], router_aux_loss_coef=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GptOssForCausalLM(config)


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.slow
def test_gpt_oss_experts_move_tokens_by_all_to_all_and_train_like_torch():
    model, ref = _gpt_oss(), _gpt_oss()
    assert "router_indices" in str(inspect.signature(model.model.layers[0].mlp.experts.forward))
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(3, 64, (8, 16), generator=g) for _ in range(3)]
    rules = presets.hf_rules(model, axis=None, expert_axis="expert", fsdp_min_size=1024)
    plan = ts.plan(model, ts.make_mesh(AXES), rules)
    trainer = ts.Trainer(model, _lm_loss, optax.adamw(1e-3), plan, batch_spec=BATCH_SPEC)
    assert trainer.strategies["expert_dispatch"].option == ts.ExpertDispatch("all_to_all")
    losses = [float(trainer.step(ids)["loss"]) for ids in data]
    expected = torch_losses(ref, _lm_loss, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-4), data)
    np.testing.assert_allclose(losses, expected, rtol=RTOL)
    assert ts.inspect.collectives(trainer, data[0]).count("all-to-all", axes="expert") >= 2 * 4
    capped = ts.Trainer(_gpt_oss(), _lm_loss, optax.adamw(1e-3), plan, batch_spec=BATCH_SPEC,
                        expert_dispatch=ts.ExpertDispatch(capacity_factor=1.0))  # fmt: skip
    assert "dropped_tokens" in capped.step(data[0])


# bf16 MixedPrecision with all-to-all on data × expert × model: the step's gradient sum over the data axis
# once ran as a bf16 psum inside the dispatch's shard_map, which XLA's CPU compiler aborted on ("Invalid
# binary instruction opcode copy"), killing the process; so the Trainer runs in a child process
BF16_ON_EXPERT_X_MODEL = """
import json, sys
import optax, torch
import torchshard as ts
from tools.families import MOE, build, lm_loss
from jax.sharding import PartitionSpec as P
ts.use_cpu_devices(8)
model = build(next(f for f in MOE if f.model_type == sys.argv[1]))
rules = ts.presets.hf_rules(model, axis="model", expert_axis="expert", fsdp_axis="data")
plan = ts.plan(model, ts.make_mesh({"data": 2, "expert": 2, "model": 2}), rules)
trainer = ts.Trainer(model, lm_loss, optax.adamw(float(sys.argv[2]), weight_decay=float(sys.argv[3])), plan,
                     batch_spec=P(("data", "expert")), expert_dispatch=ts.ExpertDispatch(),
                     precision=ts.MixedPrecision())
print(json.dumps([float(trainer.step(torch.tensor(ids))["loss"]) for ids in json.loads(sys.stdin.read())]))
"""


@pytest.mark.slow
def test_bf16_all_to_all_on_expert_x_model_compiles_and_trains_like_the_eager_bf16_policy():
    from testsupport.helpers import root_env
    from testsupport.precision import LR, RTOL, WD, torch_mixed_precision
    from tools.families import MOE, build, lm_loss

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(3, 128, (8, 16), generator=g) for _ in range(3)]
    args = ["mixtral", str(LR), str(WD)]
    done = subprocess.run([sys.executable, "-c", BF16_ON_EXPERT_X_MODEL, *args], env=root_env(), input=json.dumps(
        [ids.tolist() for ids in data]), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    expected = torch_mixed_precision(build(next(f for f in MOE if f.model_type == "mixtral")), lm_loss, data)
    np.testing.assert_allclose(json.loads(done.stdout.splitlines()[-1]), expected, rtol=RTOL)


class Tempered(nn.Module):
    """A linear layer under a learnable temperature (CLIP's ``logit_scale``): a 0-d parameter, which has no dim 0."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.proj(x) * self.logit_scale.exp()


def test_a_model_with_a_0d_parameter_builds_a_trainer_and_trains_like_torch():
    torch.manual_seed(0)
    reference = Tempered()
    model = copy.deepcopy(reference)
    plan = ts.plan(model, ts.make_mesh({"data": 8}), presets.fsdp(min_size=1))
    trainer = ts.Trainer(model, mse, optax.adamw(1e-2), plan, batch_spec=P("data"))
    assert trainer.strategies["expert_dispatch"].option is None
    losses, _ = _losses(trainer, _batches())
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=1e-4)
    np.testing.assert_allclose(losses, torch_losses(reference, mse, opt, _batches()), rtol=RTOL)
