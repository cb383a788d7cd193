"""The 1F1B pipeline schedule: parity with eager torch and the unpipelined run, composition, memory against gpipe."""

from __future__ import annotations

import numpy as np
import optax
import pytest
import torch
from test_pipeline import BLOCK_TP, FSDP, LR, WD, adamw, batches, blocks, blocks_loss, hf_loss, values

import torchshard as ts
from testsupport.helpers import assert_trees_close, torch_losses
from testsupport.models import BlockStack, tiny_llama
from torchshard import ArgumentError, Pipeline, ShardingError, presets

ONE_F_ONE_B = Pipeline(microbatches=4, schedule="1f1b")


def pipelined(model, axes, rules, pipeline=ONE_F_ONE_B, **kwargs):
    return ts.Trainer(model, blocks_loss, adamw(), ts.plan(model, ts.make_mesh(axes), rules), pipeline=pipeline,
                      **kwargs)  # fmt: skip


@pytest.mark.slow
def test_trains_like_eager_torch_and_like_the_unpipelined_run():
    trains_like_eager_torch_and_like_the_unpipelined_run(ONE_F_ONE_B)


def trains_like_eager_torch_and_like_the_unpipelined_run(pipeline):
    """4 AdamW steps over stage=4 × data=2 FSDP against eager torch and the unpipelined run (also zero_bubble's)."""
    eager_model = blocks()
    opt = torch.optim.AdamW(eager_model.parameters(), lr=LR, weight_decay=WD)
    expected = torch_losses(eager_model, blocks_loss, opt, batches(4))
    model = blocks()
    dense = ts.Trainer(model, blocks_loss, adamw(), ts.plan(model, ts.make_mesh({"data": 8}), FSDP))
    dense_losses = [float(dense.step(b)["loss"]) for b in batches(4)]
    run = pipelined(blocks(), {"stage": 4, "data": 2}, FSDP, pipeline)
    losses = [float(run.step(b)["loss"]) for b in batches(4)]
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    np.testing.assert_allclose(losses, dense_losses, rtol=1e-5)
    assert_trees_close(values(run.model), values(dense.model), tol=1e-4)
    assert_trees_close(values(run.model), values(eager_model), tol=1e-4)


@pytest.mark.slow
def test_hf_llama_trains_like_eager_torch():
    hf_llama_trains_like_eager_torch(ONE_F_ONE_B)


def hf_llama_trains_like_eager_torch(pipeline):
    """A tiny HF Llama with padding over stage=2 × data=2 × model=2 (TP and FSDP inside the stages)."""
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[::3, -4:] = 0  # padding: the 4-D mask is split into micro-batches with the hidden state
    data = [(torch.randint(0, 128, (8, 12), generator=g), mask) for _ in range(4)]
    ref = tiny_llama(layers=4)
    expected = torch_losses(ref, hf_loss, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD), data)
    model = tiny_llama(layers=4)
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 2, "model": 2}),
                   presets.hf_rules(model, axis="model", fsdp_axis="data", fsdp_min_size=1024))  # fmt: skip
    run = ts.Trainer(model, hf_loss, adamw(), plan, pipeline=pipeline)
    np.testing.assert_allclose([float(run.step(b)["loss"]) for b in data], expected, rtol=1e-4)
    assert_trees_close(values(run.model), values(ref), tol=1e-4)


@pytest.mark.slow
def test_tensor_parallel_mixed_precision_remat_and_grad_accum_compose():
    tensor_parallel_mixed_precision_remat_and_grad_accum_compose(ONE_F_ONE_B)


def tensor_parallel_mixed_precision_remat_and_grad_accum_compose(pipeline):
    from testsupport.precision import RTOL, torch_mixed_precision
    from testsupport.precision import blocks_loss as float_loss  # the loss in fp32 (bf16 losses are 1/128 apart)

    data = batches(3, rows=16)  # 2 accumulation steps × 4 micro-batches × data=2
    expected = torch_mixed_precision(blocks(), float_loss, data)
    model = blocks()
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 2, "model": 2}), BLOCK_TP)
    run = ts.Trainer(model, float_loss, adamw(), plan, pipeline=pipeline, precision=ts.MixedPrecision(),
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


def compiled(schedule, microbatches=8, rows=16):
    run = pipelined(blocks(), {"stage": 4, "data": 2}, FSDP, Pipeline(microbatches=microbatches, schedule=schedule))
    return run.lower(batches(1, rows=rows)[0]).compile()


@pytest.mark.slow
def test_computes_what_gpipe_computes_and_keeps_less_without_remat():
    """What the benchmark reports at S=4, M=8, here on a tiny stack, from the compiled steps: the same FLOPs as
    gpipe with nothing recomputed, less temp (2S-1 micro-batches in flight, not M+S-1), and a temp that does not
    grow with M as gpipe's does."""
    from torchshard._hlo.costs import step_costs

    steps = {schedule: compiled(schedule) for schedule in ("gpipe", "1f1b", "1f1b_remat")}
    costs = {schedule: step_costs(str(c.as_text())) for schedule, c in steps.items()}
    temp = {schedule: c.memory_analysis().temp_size_in_bytes for schedule, c in steps.items()}
    assert costs["1f1b"].flops <= 1.05 * costs["gpipe"].flops
    assert costs["1f1b"].recompute_flops == 0
    assert costs["1f1b_remat"].flops >= 1.1 * costs["gpipe"].flops  # the forward it runs twice
    # not the 0.6 the issue asks: stage 0 holds 2S-1 = 7 micro-batches' residuals against gpipe's 11 iterations'
    assert temp["1f1b"] < temp["gpipe"]
    assert temp["1f1b_remat"] <= 0.6 * temp["gpipe"]
    twice = {schedule: compiled(schedule, 16, 32).memory_analysis().temp_size_in_bytes for schedule in temp}
    assert twice["1f1b"] - temp["1f1b"] <= 0.25 * (twice["gpipe"] - temp["gpipe"])


class Counted(torch.nn.Module):
    """A BlockStack whose head is preceded by a BatchNorm: running stats updated outside the stack."""

    def __init__(self):
        super().__init__()
        self.stack = blocks(4)
        self.stats = torch.nn.BatchNorm1d(32)

    def forward(self, ids):
        h = self.stack.embed(ids)
        for block in self.stack.blocks:
            h = block(h)
        return self.stack.head(self.stats(h.transpose(1, 2)).transpose(1, 2))


class Doubled(torch.nn.Module):
    """A BlockStack whose code before the stack doubles the rows of batches of more than 2: not row by row."""

    def __init__(self, grow=1):
        super().__init__()
        self.stack, self.grow = blocks(4), grow

    def forward(self, ids):
        h = self.stack.embed(ids)
        n = h.shape[0] * self.grow + (1 if self.grow > 2 else 0)
        h = h.repeat(4, 1, 1)[:n].clone() if h.shape[0] > 2 else h
        for block in self.stack.blocks:
            h = block(h)
        return self.stack.head(h)[: ids.shape[0]]


@pytest.mark.parametrize(
    ("model", "loss_fn", "match"),
    [
        (Counted, blocks_loss, r"updates buffer\(s\) \['stats\.num_batches_tracked', 'stats\.running_mean', "
         r"'stats\.running_var'\] outside its stack .* use schedule='gpipe'"),
        (lambda: Doubled(2), blocks_loss, r"the stack got a hidden state \[2, 11, 32\] for one micro-batch, expected "
         r"\[4, 11, 32\]; the model's code before the stack must treat rows independently"),
        (lambda: Doubled(3), blocks_loss, r"the stack's input \[25, 11, 32\] does not split into microbatches=4 .* "
         r"must keep the batch's rows \(a multiple of 4\)"),
    ],
)  # fmt: skip
def test_what_it_cannot_run_is_refused(model, loss_fn, match):
    model = model()
    run = ts.Trainer(model, loss_fn, adamw(), ts.plan(model, ts.make_mesh({"stage": 4, "data": 2}), FSDP),
                     pipeline=ONE_F_ONE_B)  # fmt: skip
    with pytest.raises(ShardingError, match=match):
        run.step(batches(1)[0])


def test_bubble_is_gpipe_s():
    assert Pipeline(microbatches=8, schedule="1f1b").bubble(stages=4) == pytest.approx(3 / 11)


def test_one_pass_only():
    with pytest.raises(ArgumentError, match=r"repeats=2 needs schedule='circular' \(1f1b makes one pass\)"):
        Pipeline(microbatches=4, schedule="1f1b", repeats=2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "1f1b_remat"])
def test_sgd_update_is_the_unpipelined_one(schedule):
    """One SGD step: the interleaved (or recomputed) backward gives the gradients autodiff of the whole stack gives."""
    batch = batches(1)[0]
    runs = []
    for axes, pipeline in (({"data": 8}, None), ({"stage": 4, "data": 2}, Pipeline(microbatches=4, schedule=schedule))):
        model = blocks(4)
        run = ts.Trainer(model, blocks_loss, optax.sgd(0.1), ts.plan(model, ts.make_mesh(axes), FSDP),
                         pipeline=pipeline)  # fmt: skip
        run.step(batch)
        runs.append(values(run.model))
    assert_trees_close(runs[1], runs[0], tol=1e-5)


class Scaled(torch.nn.Module):
    """A block with a constant buffer it reads (Apertus' XIELU keeps its beta and eps so)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.up = torch.nn.Linear(dim, dim)
        self.register_buffer("beta", torch.tensor(0.5))

    def forward(self, h):
        return h + self.beta * torch.tanh(self.up(h))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_blocks_that_read_buffers_train_like_eager_torch(schedule):
    # the stack's cast handed its buffers back with the weights, and the loop gives only the weights a
    # gradient: the vjp refused the cotangent ("unexpected tree structure") on Apertus in the matrix
    def build():
        torch.manual_seed(0)
        model = BlockStack(depth=4)
        model.blocks = torch.nn.ModuleList(Scaled() for _ in range(4))
        return model

    eager = build()
    optimizer = torch.optim.AdamW(eager.parameters(), lr=LR, weight_decay=WD)
    expected = torch_losses(eager, blocks_loss, optimizer, batches(3))
    run = pipelined(build(), {"stage": 4, "data": 2}, FSDP, Pipeline(microbatches=4, schedule=schedule))
    np.testing.assert_allclose([float(run.step(b)["loss"]) for b in batches(3)], expected, rtol=1e-4)
