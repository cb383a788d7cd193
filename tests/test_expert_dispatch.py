"""All-to-all expert dispatch: tokens travel to their experts' devices and back, and train like eager torch.

The truth is the same model run unsharded in eager torch (AdamW losses rtol 1e-4, as the family table).
"""

from __future__ import annotations

import copy

import numpy as np
import optax
import pytest
import torch
from helpers import torch_losses
from jax.sharding import PartitionSpec as P
from models import Experts, MoEStack

import torchshard as ts
from torchshard import ArgumentError, ShardingError, presets

RTOL = 1e-4
EXPERTS = Experts.count
AXES = {"data": 2, "expert": 4}
BATCH_SPEC = P(("data", "expert"))


def mse(model, batch):
    x, y = batch
    return (model(x) - y).square().mean()


def _model(seed: int = 0) -> MoEStack:
    torch.manual_seed(seed)
    return MoEStack()


def _batches(steps: int = 4, rows: int = 16, seq: int = 4):
    g = torch.Generator().manual_seed(1)
    shape = (rows, seq, Experts.dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(steps)]


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
    assert trainer.expert_dispatch == ts.ExpertDispatch("all_to_all")
    np.testing.assert_allclose(losses, eager, rtol=RTOL)
    assert "dropped_tokens" not in metrics[0]  # dropless: nothing to report


def test_the_step_moves_tokens_by_all_to_all_over_the_expert_axis(dispatched):
    trainer, _ = dispatched
    stats = ts.inspect.collectives(trainer, _batches(1)[0])
    # per layer: tokens, expert ids and used flags out, results back; the backward pass the same way
    assert stats.count("all-to-all", axes="expert") >= 2 * 4, str(stats)


def test_gspmd_keeps_the_plan_alone_and_trains_the_same(eager):
    trainer = _trainer(_model(), expert_dispatch=ts.ExpertDispatch("gspmd"))
    losses, _ = _losses(trainer, _batches())
    np.testing.assert_allclose(losses, eager, rtol=RTOL)
    assert ts.inspect.collectives(trainer, _batches(1)[0]).count("all-to-all", axes="expert") == 0


def _overloaded() -> MoEStack:
    """Every token's first choice is expert 0 (its router bias dwarfs the logits)."""
    model = _model()
    with torch.no_grad():
        for layer in model.layers:
            layer.router.bias.zero_()
            layer.router.bias[0] = 50.0
    return model


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


def test_the_default_falls_back_to_the_plan_where_all_to_all_cannot_run(eager):
    trainer = _trainer(_model(), batch_spec=P("data"))
    assert trainer.expert_dispatch is None
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
    from families import build, loss_and_aux, with_router_logits

    reference = build(with_router_logits(family))
    model = copy.deepcopy(reference)
    loss_fn = loss_and_aux

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (8, 16), generator=g) for _ in range(3)]
    rules = presets.hf_rules(model, axis=None, expert_axis="expert", fsdp_min_size=1024)
    trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), ts.plan(model, ts.make_mesh(AXES), rules),
                         batch_spec=BATCH_SPEC, scan_layers=True)  # fmt: skip
    assert trainer.expert_dispatch == ts.ExpertDispatch("all_to_all")
    got = [trainer.step(b) for b in data]
    expected = torch_losses(reference, lambda m, ids: loss_fn(m, ids)[0],
                            torch.optim.SGD(reference.parameters(), lr=0.1), data)  # fmt: skip
    np.testing.assert_allclose([float(m["loss"]) for m in got], expected, rtol=RTOL)
    assert float(got[0]["aux_loss"]) > 0.1
