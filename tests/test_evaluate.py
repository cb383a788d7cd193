"""Trainer.evaluate vs eager torch: values, eval mode, an unchanged state, the options, captured tensors, errors."""

from __future__ import annotations

import copy
import dataclasses

import jax
import numpy as np
import optax
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import torchshard as ts
from testsupport.evaluation import RTOL
from testsupport.helpers import assert_close, to_numpy
from testsupport.models import BlockStack, MoEStack, tiny_llama
from tools.families import build, family
from torchshard import ArgumentError, ContextParallel, MixedPrecision, Pipeline, ShardingError, presets
from torchshard._trainer import evaluate as evaluate_module
from torchshard._trainer.trainer import core_of


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def block_loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def ids(rows=8, seq=16, vocab=128, seed=0):
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


class Noisy(nn.Module):
    """Dropout and BatchNorm: what eval mode changes."""

    def __init__(self):
        super().__init__()
        self.up, self.bn, self.down = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.down(F.dropout(torch.relu(self.bn(self.up(x))), 0.5, self.training))


def mse(model, batch):
    x, y = batch
    return (model(x) - y).square().mean()


def xy(rows=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


@pytest.fixture(scope="module")
def llama():
    """A tiny HF Llama on data=4 × model=2 (hf_rules), trained two AdamW steps."""
    model = tiny_llama()
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), presets.hf_rules(model))
    trainer = ts.Trainer(model, lm_loss, optax.adamw(1e-3), plan)
    for seed in range(2):
        trainer.step(ids(seed=seed))
    return trainer


def eager_copy(trainer, factory):
    reference = factory()
    reference.load_state_dict(ts.to_torch_state_dict(trainer.model))
    return reference.eval()


@pytest.mark.slow
def test_the_loss_and_any_function_equal_eager_torch(llama):
    reference = eager_copy(llama, lambda: tiny_llama())
    batch = ids(seed=5)
    with torch.no_grad():
        expected = reference(input_ids=batch, labels=batch)
    got = llama.evaluate(batch)
    assert set(got) == {"loss"}
    assert_close(got["loss"], expected.loss, tol=RTOL)
    logits = llama.evaluate(batch, lambda m, b: m(input_ids=b).logits)["output"]
    assert_close(logits, expected.logits, tol=RTOL)
    both = llama.evaluate(batch, lambda m, b: {"logits": m(input_ids=b).logits, "first": m(input_ids=b).logits[0, 0]})
    assert sorted(both) == ["first", "logits"]
    assert_close(both["first"], expected.logits[0, 0], tol=RTOL)


def test_nothing_in_the_state_changes_and_the_mode_is_restored():
    torch.manual_seed(0)
    model = Noisy()
    trainer = ts.Trainer(model, mse, optax.adamw(1e-2), ts.plan(model, ts.make_mesh({"data": 8})))
    trainer.step(xy())
    before = jax.tree.map(np.asarray, (trainer.state, trainer.rng_key))
    reference = eager_copy(trainer, Noisy)
    first, second = trainer.evaluate(xy(seed=3)), trainer.evaluate(xy(seed=3))
    with torch.no_grad():
        expected = mse(reference, xy(seed=3))  # eval mode: dropout off, BatchNorm on its running statistics
    assert_close(first["loss"], expected, tol=RTOL)
    assert float(first["loss"]) == float(second["loss"])
    after = jax.tree.map(np.asarray, (trainer.state, trainer.rng_key))
    assert jax.tree.all(jax.tree.map(np.array_equal, before, after))
    assert trainer.model.training and trainer.model.bn.training
    assert trainer.step_count == 1


def test_compiled_once_per_function_and_shape_with_a_bounded_cache(monkeypatch):
    model = nn.Linear(8, 4)
    trainer = ts.Trainer(model, mse, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})))
    cache = core_of(trainer).evaluations
    trainer.evaluate(xy())
    trainer.evaluate(xy(seed=1))
    assert len(cache) == 1
    trainer.evaluate(xy(rows=32))
    assert len(cache) == 2
    monkeypatch.setattr(evaluate_module, "CACHE_SIZE", 2)
    trainer.evaluate(xy(rows=24))
    assert len(cache) == 2


def pipelined():
    torch.manual_seed(0)
    model = BlockStack(depth=4)
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 4}), presets.fsdp(min_size=256))
    return ts.Trainer(model, block_loss, optax.adamw(1e-3), plan, pipeline=Pipeline(microbatches=2))


def scanned_mixed():
    model = tiny_llama(layers=3)
    plan = ts.plan(model, ts.make_mesh({"data": 8}), presets.fsdp(min_size=256))
    return ts.Trainer(model, lm_loss, optax.adamw(1e-3), plan, scan_layers=True, precision=MixedPrecision(),
                      grad_accum_steps=2)  # fmt: skip


def context():
    model = tiny_llama(attention_dropout=0.0)
    plan = ts.plan(model, ts.make_mesh({"data": 2, "context": 4}), presets.fsdp(min_size=256))
    return ts.Trainer(model, lm_loss, optax.adamw(1e-3), plan, context=ContextParallel(),
                      batch_spec=("data", "context"))  # fmt: skip


def experts():
    torch.manual_seed(0)
    model = MoEStack()
    plan = ts.plan(model, ts.make_mesh({"data": 2, "expert": 4}), presets.expert_parallel([r".*experts\.(up|down)"]))
    return ts.Trainer(model, mse, optax.adamw(1e-3), plan, batch_spec=(("data", "expert"),))


def moe_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, 16, generator=g), torch.randn(16, 4, 16, generator=g)


OPTIONS = {
    "pipeline": (pipelined, lambda: ids(vocab=64, seq=12)),
    "scan+mixed precision+accumulation": (scanned_mixed, lambda: ids(rows=16)),
    "context": (context, ids),
    "expert dispatch": (experts, moe_batch),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIONS)
def test_every_option_evaluates_the_loss_its_next_step_trains_on(name):
    # each option's step is tested against eager torch; its loss is computed on the weights before the update
    make, batch = OPTIONS[name]
    trainer = make()
    assert (
        name != "expert dispatch" or trainer.strategies["expert_dispatch"].option == ts.ExpertDispatch()
    )  # all-to-all, not the plan
    b = batch()
    evaluated = float(trainer.evaluate(b)["loss"])
    assert trainer.step_count == 0
    stepped = float(trainer.step(b)["loss"])
    np.testing.assert_allclose(evaluated, stepped, rtol=RTOL)


def tiny_xlstm():
    """transformers' xLSTM (its tiny family) whose inference runs 8 tokens at a time, carrying its state between.

    Hidden 128 rather than the family's 64: xLSTMConfig sizes the state cache by ``qk_dim``, which it
    rounds up to a multiple of 64, and the layers by ``hidden_size * qk_dim_factor``. Those agree for
    the real config (4096 * 0.5) and for 128 * 0.5; for 64 * 0.5 eager torch itself fails on chunks.
    """
    xlstm = family("xlstm")
    model = build(dataclasses.replace(xlstm, extra=(*xlstm.extra, ("hidden_size", 128))))
    model.config.max_inference_chunksize = 8
    return model


def xlstm_loss(model, ids):
    # without a cache, as the Trainer runs the model (with one, eager torch keeps the chunks' states in float32)
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.slow
@pytest.mark.parametrize("fused_loss", [False, True])  # True: xLSTM soft-caps its chunked logits in place
def test_xlstm_evaluates_sequences_longer_than_its_inference_chunks(fused_loss):
    # each chunk copy_'s its recurrent state (a view) into the cache: torchax's copy_ could not read a view
    model = tiny_xlstm()
    reference = copy.deepcopy(model).eval()
    plan = ts.plan(model, ts.make_mesh({"data": 8}), presets.hf_rules(model, axis=None))
    trainer = ts.Trainer(model, xlstm_loss, optax.adamw(1e-3), plan, fused_loss=fused_loss)
    batch = ids(seq=5 * 8)
    with torch.no_grad():
        expected = xlstm_loss(reference, batch)

    # the loss, not each logit: the chunks pass their state on in a bfloat16 cache (transformers' choice), where
    # states one float32 rounding apart may round to neighbouring bfloat16 values (logits then differ by ~2e-4)
    assert_close(trainer.evaluate(batch)["loss"], expected, tol=RTOL)


class Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(x)


def test_tensors_captured_from_outside_are_constants_as_in_eager_torch():
    weight = torch.tensor([1.0, 2.0, 0.5, 3.0])  # class weights: a plain CPU tensor
    table = nn.Module()
    table.register_buffer("shift", torch.arange(4))  # another module's buffer, int64
    loss_fn = lambda m, b: F.cross_entropy(m(b[0]), (b[1] + table.shift[b[1]]) % 4, weight=weight)  # noqa: E731
    torch.manual_seed(0)
    model = Weighted()
    reference = copy.deepcopy(model)
    trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})))
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(1)))
    stepped = trainer.step(batch)["loss"]
    expected = loss_fn(reference, batch)
    assert_close(stepped, expected, tol=RTOL)
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_close(trainer.evaluate(batch)["loss"], loss_fn(reference, batch), tol=RTOL)


def test_bad_input_names_the_culprit(llama):
    with pytest.raises(ArgumentError, match=r"fn must be a function fn\(model, batch\), got 3"):
        llama.evaluate(ids(), 3)
    with pytest.raises(ArgumentError, match=r"fn returned float for 'loss'; return a tensor"):
        llama.evaluate(ids(), lambda m, b: {"loss": 1.0})
    with pytest.raises(ArgumentError, match=r"batch leaf #0 is float32\[8, 16\]; the training batches' leaf #0 "
                                            r"had rank 2 and signed integer values"):  # fmt: skip
        llama.evaluate(ids().float())
    with pytest.raises(ArgumentError, match=r"batch leaf #0 is int64\[8\]; .* had rank 2"):
        llama.evaluate(ids()[:, 0])
    with pytest.raises(ArgumentError, match=r"the batch is a PyTreeDef\(\(\*, \*\)\), the training batches were"):
        llama.evaluate((ids(), ids()))
    with pytest.raises(ShardingError, match=r"batch leaf #0 \(6, 16\) .*dim 0 \(size 6\) is not divisible by data"):
        llama.evaluate(ids(rows=6))
    assert to_numpy(llama.evaluate(ids())["loss"]).shape == ()


class _NoSuchMetric(Exception):
    pass


def _failing_fn(model, batch):
    raise _NoSuchMetric("bleu needs references")


def test_an_fn_that_raises_keeps_its_type_and_says_which_call_it_came_from():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    trainer = ts.Trainer(model, mse, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})))
    with pytest.raises(_NoSuchMetric, match="bleu needs references") as info:  # callers may catch their own errors
        trainer.evaluate(xy(), _failing_fn)
    assert "(raised while Trainer.evaluate traced fn=_failing_fn)" in info.value.__notes__  # and JAX's own
    assert trainer.step_count == 0 and float(trainer.evaluate(xy())["loss"]) > 0  # nothing changed, still usable
