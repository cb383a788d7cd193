"""The 1F1B pipeline schedule: parity with eager torch and the unpipelined run, composition, memory against gpipe."""

from __future__ import annotations

import numpy as np
import optax
import pytest
import torch
from helpers import assert_trees_close, torch_losses
from models import tiny_llama
from test_pipeline import BLOCK_TP, FSDP, LR, WD, adamw, batches, blocks, blocks_loss, hf_loss, values

import torchshard as ts
from torchshard import ArgumentError, Pipeline, presets

ONE_F_ONE_B = Pipeline(microbatches=4, schedule="1f1b")


def pipelined(model, axes, rules, pipeline=ONE_F_ONE_B, **kwargs):
    return ts.Trainer(model, blocks_loss, adamw(), ts.plan(model, ts.make_mesh(axes), rules), pipeline=pipeline,
                      **kwargs)  # fmt: skip


@pytest.mark.slow
def test_trains_like_eager_torch_and_like_the_unpipelined_run():
    eager_model = blocks()
    opt = torch.optim.AdamW(eager_model.parameters(), lr=LR, weight_decay=WD)
    expected = torch_losses(eager_model, blocks_loss, opt, batches(4))
    model = blocks()
    dense = ts.Trainer(model, blocks_loss, adamw(), ts.plan(model, ts.make_mesh({"data": 8}), FSDP))
    dense_losses = [float(dense.step(b)["loss"]) for b in batches(4)]
    run = pipelined(blocks(), {"stage": 4, "data": 2}, FSDP)
    losses = [float(run.step(b)["loss"]) for b in batches(4)]
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    np.testing.assert_allclose(losses, dense_losses, rtol=1e-5)
    assert_trees_close(values(run.model), values(dense.model), tol=1e-4)
    assert_trees_close(values(run.model), values(eager_model), tol=1e-4)


@pytest.mark.slow
def test_hf_llama_trains_like_eager_torch():
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[::3, -4:] = 0  # padding: the 4-D mask is split into micro-batches with the hidden state
    data = [(torch.randint(0, 128, (8, 12), generator=g), mask) for _ in range(4)]
    ref = tiny_llama(layers=4)
    expected = torch_losses(ref, hf_loss, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD), data)
    model = tiny_llama(layers=4)
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 2, "model": 2}),
                   presets.hf_rules(model, axis="model", fsdp_axis="data", fsdp_min_size=1024))  # fmt: skip
    run = ts.Trainer(model, hf_loss, adamw(), plan, pipeline=ONE_F_ONE_B)
    np.testing.assert_allclose([float(run.step(b)["loss"]) for b in data], expected, rtol=1e-4)
    assert_trees_close(values(run.model), values(ref), tol=1e-4)


@pytest.mark.slow
def test_tensor_parallel_mixed_precision_remat_and_grad_accum_compose():
    from test_precision import RTOL, torch_mixed_precision
    from test_precision import blocks_loss as float_loss  # the loss in fp32 (bf16 losses are 1/128 apart)

    data = batches(3, rows=16)  # 2 accumulation steps × 4 micro-batches × data=2
    expected = torch_mixed_precision(blocks(), float_loss, data)
    model = blocks()
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 2, "model": 2}), BLOCK_TP)
    run = ts.Trainer(model, float_loss, adamw(), plan, pipeline=ONE_F_ONE_B, precision=ts.MixedPrecision(),
                     remat=r"blocks\.\d+\.up", grad_accum_steps=2)  # fmt: skip
    np.testing.assert_allclose([float(run.step(b)["loss"]) for b in data], expected, rtol=RTOL)


@pytest.mark.slow
def test_checkpoints_load_into_and_out_of_gpipe(tmp_path):
    data = batches(3)
    gpipe = pipelined(blocks(), {"stage": 4, "data": 2}, FSDP, Pipeline(microbatches=4))
    for b in data[:2]:
        gpipe.step(b)
    ts.save(tmp_path, gpipe)
    resumed = pipelined(blocks(), {"stage": 2, "data": 4}, FSDP, Pipeline(microbatches=2, schedule="1f1b"))
    ts.load(tmp_path, resumed)
    assert_trees_close(values(resumed.model), values(gpipe.model), tol=0)
    np.testing.assert_allclose(float(resumed.step(data[2])["loss"]), float(gpipe.step(data[2])["loss"]), rtol=1e-5)


@pytest.mark.slow
def test_keeps_less_than_gpipe_without_remat():
    """The measure the benchmark reports at S=4, M=8, here on a tiny stack: compiled temp bytes against gpipe's."""
    batch = batches(1, rows=16)[0]
    temp = {}
    for schedule in ("gpipe", "1f1b"):
        run = pipelined(blocks(), {"stage": 4, "data": 2}, FSDP, Pipeline(microbatches=8, schedule=schedule))
        temp[schedule] = run.lower(batch).compile().memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] <= 0.6 * temp["gpipe"]


def test_bubble_is_gpipe_s():
    assert Pipeline(microbatches=8, schedule="1f1b").bubble(stages=4) == pytest.approx(3 / 11)


def test_one_pass_only():
    with pytest.raises(ArgumentError, match=r"repeats=2 needs schedule='circular' \(1f1b makes one pass\)"):
        Pipeline(microbatches=4, schedule="1f1b", repeats=2)


@pytest.mark.slow
def test_sgd_update_is_the_unpipelined_one():
    """One SGD step: the recomputed backward gives the gradients autodiff of the whole stack gives."""
    batch = batches(1)[0]
    runs = []
    for axes, pipeline in (({"data": 8}, None), ({"stage": 4, "data": 2}, ONE_F_ONE_B)):
        model = blocks(4)
        run = ts.Trainer(model, blocks_loss, optax.sgd(0.1), ts.plan(model, ts.make_mesh(axes), FSDP),
                         pipeline=pipeline)  # fmt: skip
        run.step(batch)
        runs.append(values(run.model))
    assert_trees_close(runs[1], runs[0], tol=1e-5)
