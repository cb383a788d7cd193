"""Class-index losses at their edges, against eager torch: every label ignored, labels out of range, int32 labels.

Every label ignored: eager torch's mean is nan and its gradients are 0, at every chunking of
``ts.linear_cross_entropy``, in ``F.cross_entropy``'s lowering and in the fused HF loss (a step
then leaves SGD's parameters as they were). A label outside ``[0, vocab)`` that is not
``ignore_index``: eager torch raises; a plain-torch call raises `ArgumentError` (its table is in
test_linear_cross_entropy.py), and inside a step, where nothing can raise, the loss and every
gradient are nan, which ``skip_nonfinite`` skips. Gradients within 1e-5 of eager torch's.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torchax.interop
from torch.nn import functional as F

import torchshard as ts
from testsupport.helpers import assert_close, eager_value_and_grads
from torchshard._bridge.env import env
from torchshard._bridge.ops import linear_cross_entropy as lowering

VOCAB, WIDTH, TOKENS = 40, 16, 32
CHUNKINGS = [None, 1, 5, 8, 32]  # one chunk, 32 chunks, 7 chunks (padded), 4 chunks, one chunk again


@pytest.fixture(autouse=True, scope="module")
def _torchshard_lowerings():
    env()


def _inputs(labels: torch.Tensor) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(TOKENS, WIDTH, generator=gen), torch.randn(VOCAB, WIDTH, generator=gen) / 4, labels]


def _on_jax(fn, inputs):
    """``fn`` jitted on the inputs as jax arrays: (value, [dhidden, dweight])."""
    arrays = [jnp.asarray(x.numpy()) for x in inputs]
    value, grads = jax.jit(jax.value_and_grad(torchax.interop.jax_view(fn), argnums=(0, 1)))(*arrays)
    return value, list(grads)


def _chunked(chunk_tokens):
    return lambda h, w, y: ts.linear_cross_entropy(h, w, y, chunk_tokens=chunk_tokens)


def _plain(h, w, y):
    return F.cross_entropy(h @ w.T, y)


IGNORED = torch.full((TOKENS,), -100)


@pytest.mark.parametrize("chunk_tokens", CHUNKINGS)
def test_every_label_ignored_gives_a_nan_loss_and_zero_gradients_as_eager_torch(chunk_tokens):
    inputs = _inputs(IGNORED)
    expected, expected_grads = eager_value_and_grads(_plain, inputs, argnums=(0, 1))
    assert torch.isnan(expected) and all(not g.any() for g in expected_grads)  # the truth, as stated
    fn = _chunked(chunk_tokens)
    for where, (value, grads) in {
        "jax": _on_jax(fn, inputs),
        "eager torch": eager_value_and_grads(fn, inputs, argnums=(0, 1)),
    }.items():
        assert np.isnan(float(value)), where
        for what, got, want in zip(("dhidden", "dweight"), grads, expected_grads, strict=True):
            assert_close(got, want, what=f"{what} ({where}, chunk_tokens={chunk_tokens})")


def test_cross_entropys_lowering_gives_every_ignored_label_zero_gradients():
    inputs = _inputs(IGNORED)
    _, expected_grads = eager_value_and_grads(_plain, inputs, argnums=(0, 1))
    value, grads = _on_jax(_plain, inputs)  # F.cross_entropy in a trace: torchshard's fused lowering
    assert np.isnan(float(value))
    for got, want in zip(grads, expected_grads, strict=True):
        assert_close(got, want, what="gradient")


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
@pytest.mark.parametrize("fn", [_plain, _chunked(None), _chunked(5)], ids=["cross_entropy", "one_chunk", "chunks"])
def test_a_label_out_of_range_in_a_trace_makes_the_loss_and_every_gradient_nan(fn, bad):
    labels = torch.arange(TOKENS) % VOCAB
    labels[3] = bad
    with pytest.raises(IndexError):  # eager torch's answer, which a compiled step cannot give
        _plain(*_inputs(labels))
    value, grads = _on_jax(fn, _inputs(labels))
    assert np.isnan(float(value)) and all(bool(jnp.isnan(g).all()) for g in grads)


def test_int32_labels_are_class_indices_as_int64_ones():
    labels = (torch.arange(TOKENS) * 7) % VOCAB
    labels[::5] = -100
    expected, expected_grads = eager_value_and_grads(_plain, _inputs(labels), argnums=(0, 1))
    for where, (value, grads) in {
        "jax": _on_jax(_chunked(8), _inputs(labels.int())),
        "eager torch": eager_value_and_grads(_chunked(8), _inputs(labels.int()), argnums=(0, 1)),
    }.items():
        assert_close(value, expected, what=f"loss ({where})")
        for got, want in zip(grads, expected_grads, strict=True):
            assert_close(got, want, what=f"gradient ({where})")


# --- inside a Trainer step: the fused HF loss and a user's own loss ---------------------------------------------

transformers = pytest.importorskip("transformers")
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96)  # fmt: skip


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def _hf_loss(model, batch):
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in ts.to_torch_state_dict(model).items()}


@pytest.mark.slow
def test_a_step_whose_labels_are_all_ignored_keeps_sgds_parameters_as_eager_torch(monkeypatch):
    monkeypatch.setattr(lowering, "LOGITS_PER_CHUNK", 1024)  # 10 tokens a chunk: the fused loss' loop
    ref = _llama()
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = (ids, torch.full_like(ids, -100))
    before = {n: t.clone() for n, t in ref.state_dict().items()}
    eager = _hf_loss(ref, batch)
    eager.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert torch.isnan(eager) and all(torch.equal(ref.state_dict()[n], t) for n, t in before.items())
    model = copy.deepcopy(_llama())
    mesh = ts.make_mesh({"data": 2}, devices=jax.devices()[:2])
    trainer = ts.Trainer(model, _hf_loss, optax.sgd(0.1), ts.plan(model, mesh))
    metrics = trainer.step(batch)
    assert np.isnan(float(metrics["loss"])) and float(metrics["grad_norm"]) == 0.0
    for name, value in _params(trainer.model).items():
        assert torch.equal(value, before[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused_hf_loss", "cross_entropy"])
def test_a_label_out_of_range_in_a_step_is_nan_and_skip_nonfinite_changes_nothing(fused):
    model = _llama()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    mesh = ts.make_mesh({"data": 2}, devices=jax.devices()[:2])
    trainer = ts.Trainer(model, _hf_loss, optax.adamw(1e-3), ts.plan(model, mesh), skip_nonfinite=True,
                         fused_loss=fused)  # fmt: skip
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, 5] = 96  # the vocabulary's size: eager torch raises
    metrics = trainer.step((ids, labels))
    assert np.isnan(float(metrics["loss"])) and float(metrics["skipped"]) == 1.0
    for name, value in _params(trainer.model).items():
        assert torch.equal(value, before[name]), name
    assert float(trainer.step((ids, ids))["skipped"]) == 0.0  # good labels: the next step is taken
