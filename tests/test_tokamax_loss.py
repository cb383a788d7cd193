"""``Trainer(fused_loss="tokamax")``: tokamax's fused linear softmax cross-entropy, or torchshard's chunks and why.

Which implementation a call gets is tested per platform, dtype and vocabulary with the platform
forced; stepping aside (a bf16 head, a vocabulary tokamax's chunked XLA loss would pad into its
softmax, a failed probe) is tested on the CPU without tokamax. Where tokamax is installed (Python
>= 3.12, jax >= 0.11.1) its chunked XLA implementation is tested against eager torch in values and
gradients (tests/helpers.py's tolerance), at the fused loss' edges (every label ignored: a nan loss
and zero gradients; a label out of range: nan everywhere) and with every argument of transformers'
causal-LM loss inside a step; elsewhere those are skipped with that reason.
"""

from __future__ import annotations

import copy
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torchax.interop
from torch.nn import functional as F

import torchshard as ts
from testsupport.helpers import TOKAMAX_NEEDS, assert_close, eager_value_and_grads
from torchshard._bridge.ops import kernels, tokamax_attention, tokamax_loss

F32, BF16 = np.dtype("float32"), np.dtype(jnp.bfloat16)
TPU = "mosaic_tpu: a TPU kernel; this step runs on"

pytestmark = pytest.mark.usefixtures("fresh_probes")


def _call(vocab=256, dtype=F32) -> tokamax_loss.LossCall:
    return tokamax_loss.LossCall("lm_head", 512, 64, vocab, dtype)


def _failing(*names: str):
    return lambda kernel: "RuntimeError: injected" if kernel in names else None


INJECTED = "failed its probe (RuntimeError: injected)"
PALLAS_ON_8 = "mosaic_tpu: a mesh of 8 devices (a Pallas kernel runs per device; torchshard does not shard_map it)"
BF16_INPUTS = (
    "chunked_xla: bfloat16 inputs (its logits and per-token losses stay bfloat16; the fused loss' are float32)"
)
PADDED = "chunked_xla: a vocabulary of 96, no multiple of 128 (the padding of its blocks enters the softmax)"

# (call, platform, devices, what fails its probe, the choice)
CHOICES = [
    (_call(), "cpu", 8, (), f"tokamax:chunked_xla (forced; {TPU} cpu)"),
    (_call(), "gpu", 1, (), f"tokamax:chunked_xla (forced; {TPU} gpu)"),
    (_call(), "tpu", 1, (), "tokamax:mosaic_tpu (forced)"),
    (_call(dtype=BF16), "tpu", 1, (), "tokamax:mosaic_tpu (forced)"),
    (_call(), "tpu", 8, (), f"tokamax:chunked_xla (forced; {PALLAS_ON_8})"),
    (_call(), "tpu", 1, ("tokamax:mosaic_tpu",), f"tokamax:chunked_xla (forced; mosaic_tpu: {INJECTED})"),
    (_call(dtype=BF16), "gpu", 1, (), f"chunked (tokamax: {TPU} gpu; {BF16_INPUTS})"),
    (_call(vocab=96), "cpu", 1, (), f"chunked (tokamax: {TPU} cpu; {PADDED})"),
    (_call(), "cpu", 1, ("tokamax:chunked_xla",), f"chunked (tokamax: {TPU} cpu; chunked_xla: {INJECTED})"),
]


@pytest.mark.parametrize(("call", "platform", "devices", "failing", "expected"), CHOICES)
def test_the_loss_takes_tokamaxs_first_implementation_that_takes_the_call_else_torchshards_chunks(
    tokamax_installed, call, platform, devices, failing, expected
):
    choice = tokamax_loss.choose(call, platform, devices=devices, probe=_failing(*failing))
    assert str(choice) == expected


def test_without_tokamax_the_loss_is_torchshards_saying_why(monkeypatch):
    monkeypatch.setattr(tokamax_attention, "missing", lambda: "tokamax cannot be imported (...)")
    assert tokamax_loss.choose(_call(), "tpu") == kernels.Choice("chunked", "tokamax: tokamax cannot be imported (...)")


# ---------------------------------------------------------------- inside a Trainer: stepping aside, and saying why

transformers = pytest.importorskip("transformers")


def _llama(vocab: int = 128):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _hf_loss(model, batch):
    ids, kwargs = batch
    return model(input_ids=ids, **kwargs).loss


def _ids(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(0))


def _trainer(model, **kwargs) -> ts.Trainer:
    mesh = ts.make_mesh({"data": 2}, devices=jax.devices()[:2])
    return ts.Trainer(model, _hf_loss, optax.sgd(0.1), ts.plan(model, mesh), fused_loss="tokamax", **kwargs)


BF16_STEP = "chunked_xla: bfloat16 inputs (its logits and per-token losses stay bfloat16; the fused loss' are float32)"
STEPS_ASIDE = [
    ({"vocab": 96}, {}, f"tokamax: {TPU} cpu; {PADDED}"),
    ({}, {"precision": ts.MixedPrecision(torch.bfloat16)}, f"tokamax: {TPU} cpu; {BF16_STEP}"),
]


@pytest.mark.parametrize(("model", "kwargs", "reason"), STEPS_ASIDE, ids=["vocab_96", "bf16"])
def test_where_tokamax_cannot_honour_the_loss_torchshards_chunks_run_and_say_why(
    tokamax_installed, caplog, model, kwargs, reason
):
    trainer = _trainer(_llama(**model), **kwargs)
    with caplog.at_level(logging.INFO, logger="torchshard"):
        trainer.lower((_ids(**model), {"labels": _ids(**model)}))
    assert trainer.kernels["lm_head"] == kernels.Choice("chunked", reason)
    assert f"LlamaForCausalLM: loss fused by torchshard's chunks, not tokamax's ({reason})" in caplog.text


@pytest.mark.slow
def test_a_loss_whose_tokamax_fails_its_probe_trains_like_eager_torch_on_torchshards_chunks(
    tokamax_installed, monkeypatch
):
    """On the pinned lane tokamax is not there: its trace fails (an ImportError); elsewhere the run is made to."""
    real = tokamax_loss.run_case
    monkeypatch.setattr(
        tokamax_loss, "run_case", lambda loss, i: real(loss, i) if loss is tokamax_loss.plain else 1 / 0
    )
    model, ids = _llama(), _ids()
    batch = (ids, {"labels": ids})
    eager = copy.deepcopy(model)
    trainer = _trainer(model)
    got = float(trainer.step(batch)["loss"])
    choice = trainer.kernels["lm_head"]
    assert choice.kernel == "chunked" and choice.reason.startswith(f"tokamax: {TPU} cpu; chunked_xla: failed its probe")
    assert_close(got, float(_hf_loss(eager, batch).detach()), what="the loss on torchshard's chunks")


# ---------------------------------------------------------------- tokamax's chunked XLA loss, where installed


def _case(tokens=37, width=16, vocab=256, every=5):
    g = torch.Generator().manual_seed(tokens)
    hidden, weight = torch.randn(tokens, width, generator=g), torch.randn(vocab, width, generator=g) / 4
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[every - 1 :: every] = -100
    return [hidden, weight, labels]


def _tokamax(reduction: str = "mean"):
    from torchshard._bridge.ops.linear_cross_entropy import head_loss

    def loss(h, w, y):
        return head_loss(h, w, y, reduction=reduction, float32_out=True, implementation="chunked_xla")

    return loss


def _on_jax(fn, inputs):
    arrays = [jnp.asarray(x.numpy()) for x in inputs]
    return jax.jit(jax.value_and_grad(torchax.interop.jax_view(fn), argnums=(0, 1)))(*arrays)


LABELS = {
    "some ignored": _case(),
    "one token": _case(tokens=1),
    "a long vocabulary": _case(tokens=64, vocab=2304, every=3),  # 2304 = 18 × 128: blocks of 1152
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(LABELS))
def test_tokamax_chunked_xla_matches_eager_torch(case, reduction):
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)

    def eager(h, w, y):
        return F.cross_entropy(h @ w.T, y, reduction=reduction)

    value, grads = _on_jax(_tokamax(reduction), LABELS[case])
    want, want_grads = eager_value_and_grads(eager, LABELS[case], (0, 1))
    assert_close(value, want, what=f"{case} loss")
    for name, got, expected in zip(("hidden", "weight"), grads, want_grads, strict=True):
        assert_close(got, expected, what=f"{case} d{name}")


def test_every_label_ignored_gives_a_nan_loss_and_zero_gradients_as_eager_torch():
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    hidden, weight, labels = _case()
    value, grads = _on_jax(_tokamax(), [hidden, weight, torch.full_like(labels, -100)])
    assert np.isnan(float(value)) and all(float(jnp.abs(g).max()) == 0.0 for g in grads)


@pytest.mark.parametrize("bad", [256, -1])
def test_a_label_out_of_range_makes_the_loss_and_every_gradient_nan(bad):
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    hidden, weight, labels = _case(every=1000)  # none ignored: an ignored token's gradient is 0, even so
    labels[4] = bad
    value, grads = _on_jax(_tokamax(), [hidden, weight, labels])
    assert np.isnan(float(value)) and all(bool(jnp.isnan(g).all()) for g in grads)


def _shifted(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1).masked_fill(ids < 20, -100)


# (the batch's keyword tensors, the loss' own keywords: a batch's leaves reach the step as arrays)
CALLS = {
    "labels": (lambda ids: {"labels": ids}, {}),
    "ignore_index": (lambda ids: {"labels": ids.masked_fill(ids < 30, 5)}, {"ignore_index": 5}),
    "num_items_in_batch": (
        lambda ids: {"labels": ids.masked_fill(ids < 30, -100), "num_items_in_batch": torch.tensor(37)},
        {},
    ),
    "shift_labels": (lambda ids: {"labels": ids, "shift_labels": _shifted(ids)}, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("call", list(CALLS))
def test_a_step_on_tokamaxs_loss_matches_eager_torch_with_every_argument_of_transformers_loss(call):
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    tensors, keywords = CALLS[call]
    model, ids = _llama(), _ids()
    batch = (ids, tensors(ids))

    def loss_fn(m, b):
        return m(input_ids=b[0], **b[1], **keywords).loss

    eager = copy.deepcopy(model)
    loss = loss_fn(eager, batch)
    loss.backward()
    torch.optim.SGD(eager.parameters(), lr=0.1).step()
    mesh = ts.make_mesh({"data": 2}, devices=jax.devices()[:2])
    trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), ts.plan(model, mesh), fused_loss="tokamax")
    assert_close(float(trainer.step(batch)["loss"]), float(loss.detach()), what=f"{call}: the loss")
    assert trainer.kernels["lm_head"] == kernels.Choice("tokamax:chunked_xla", f"forced; {TPU} cpu")
    after = ts.to_torch_state_dict(trainer.model)
    for name, value in eager.state_dict().items():
        assert_close(after[name], value, what=f"{call}: {name} after a step")
