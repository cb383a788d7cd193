"""Automatic rewrites prove their assumption or step aside: the fused LM-head loss against adversarial models.

Each adversary changes what the LM head's output means after the head ran (an in-place mask as
Chameleon writes, xLSTM's in-place soft cap, forward hooks, an instance ``forward``, a class's own
``loss_function``, a peft LoRA head). The fused loss must then leave the model's own loss to run,
and say why; on an unmodified model it must still fuse. Truth: the same model's loss and
gradients in eager torch without the rewrite, within 1e-5 (`assert_close`); Trainer losses over
SGD steps within rtol 1e-4.
"""

from __future__ import annotations

import copy
import logging

import jax
import numpy as np
import optax
import pytest
import torch

import torchshard as ts
from testsupport.helpers import assert_close, torch_losses
from torchshard._strategies.fused_loss.head_loss import fused_head_losses

transformers = pytest.importorskip("transformers")
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96)  # fmt: skip
IMAGE_TOKENS = range(80, 96)  # Chameleon's IMGIMG… entries of the vocabulary map


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 79, (4, 12), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids.masked_fill(ids < 8, -100)).loss


def _llama(cls=None):
    torch.manual_seed(0)
    return (cls or transformers.LlamaForCausalLM)(transformers.LlamaConfig(**SMALL))


def _chameleon():
    vocab = {f"tok{i}": i for i in range(80)} | {f"IMGIMG{chr(65 + i)}Z": 80 + i for i in range(16)}
    config = transformers.ChameleonConfig(**SMALL, vocabulary_map=vocab, image_token_id=79)
    torch.manual_seed(0)
    return transformers.ChameleonForConditionalGeneration(config)


class MaskedInPlaceForCausalLM(transformers.LlamaForCausalLM):
    """Writes into the head's output with ``masked_fill_`` before its loss (a torch in-place op)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        logits.masked_fill_(torch.arange(logits.shape[-1]) >= 80, -1e4)
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class HiddenWrittenForCausalLM(transformers.LlamaForCausalLM):
    """Scales the head's input in place after the head ran: the head's output still holds the old product.

    Eager autograd refuses this in training (the head saved its input), so it is checked without gradients.
    """

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state * 1.0
        logits = self.lm_head(hidden)
        hidden.mul_(3.0)
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class OwnLossForCausalLM(transformers.LlamaForCausalLM):
    """A class whose ``loss_function`` is its own (label smoothing), not transformers' property."""

    @property
    def loss_function(self):
        def smoothed(logits, labels, vocab_size, **kwargs):
            shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            flat = logits.float().reshape(-1, vocab_size)
            return torch.nn.functional.cross_entropy(flat, shifted.reshape(-1), label_smoothing=0.1)

        return smoothed


def _scale_in_place(module, args, out):
    out.mul_(0.5)


def _hooked(hook):
    def build():
        model = _llama()
        model.lm_head.register_forward_hook(hook)
        return model

    return build


def _instance_forward():
    model = _llama()
    head = model.lm_head
    head.forward = lambda x: torch.nn.functional.linear(x, head.weight) * 0.5
    return model


def _peft_head():
    peft = pytest.importorskip("peft")
    model = _llama()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _xlstm_inference():
    """xLSTM in eval mode over more tokens than ``max_inference_chunksize``: it soft-caps its logits in place."""
    import dataclasses

    from tools.families import build, family

    xlstm = family("xlstm")  # hidden 128: at the family's 64, xLSTMConfig's qk_dim rounding breaks eager torch
    model = build(dataclasses.replace(xlstm, extra=(*xlstm.extra, ("hidden_size", 128))))
    model.config.max_inference_chunksize = 4
    return model.eval()


# name: (model builder, what the torchshard logger says)
ADVERSARIES = {
    "unmodified": (_llama, "loss fused with its LM head"),
    "chameleon_image_mask": (_chameleon, "the logits was written in place after the LM head ran"),
    "masked_fill_": (lambda: _llama(MaskedInPlaceForCausalLM), "the logits was written in place"),
    "head_input_written": (lambda: _llama(HiddenWrittenForCausalLM), "the head's input was written in place"),
    "hook_new_output": (_hooked(lambda m, a, out: out * 0.5), "its LM head has forward hooks"),
    "hook_in_place": (_hooked(_scale_in_place), "its LM head has forward hooks"),
    "instance_forward": (_instance_forward, "forward is replaced on the instance"),
    "own_loss_function": (lambda: _llama(OwnLossForCausalLM), "overrides transformers' loss_function"),
    "peft_lora_head": (_peft_head, "its LM head is a Linear, not a bias-free nn.Linear"),
    "xlstm_inference_soft_cap": (_xlstm_inference, "the logits was written in place"),
}


NO_GRADIENTS = {"head_input_written", "xlstm_inference_soft_cap"}  # eager autograd refuses them in training


@pytest.mark.parametrize("name", ADVERSARIES)
def test_the_fused_loss_steps_aside_where_its_assumption_fails_and_says_why(name, caplog):
    build, says = ADVERSARIES[name]
    model, ids, train = build(), _ids(), name not in NO_GRADIENTS
    with torch.set_grad_enabled(train):
        expected = lm_loss(model, ids)
    if train:
        expected.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with caplog.at_level(logging.DEBUG, logger="torchshard"), fused_head_losses(model), torch.set_grad_enabled(train):
        got = lm_loss(model, ids)
    assert says in caplog.text, caplog.text
    if train:
        got.backward()
    assert_close(got, expected.detach(), what=f"{name} loss")
    for n, p in model.named_parameters():
        if n in want:
            assert_close(p.grad, want[n], what=f"{name} grad of {n}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chameleon_image_mask", "hook_new_output"])
def test_a_trainer_on_an_adversary_trains_like_eager_torch(name, caplog):
    """Inside the jitted step torchax's ``__setitem__`` leaves the version counter as it was: the array says it."""
    build, says = ADVERSARIES[name]
    ref = build()
    model = copy.deepcopy(ref)
    one = ts.make_mesh({"data": 1}, devices=jax.devices()[:1])
    trainer = ts.Trainer(model, lm_loss, optax.sgd(0.1), ts.plan(model, one))
    data = [_ids(seed) for seed in range(3)]
    with caplog.at_level(logging.INFO, logger="torchshard"):
        got = [float(trainer.step(ids)["loss"]) for ids in data]
    assert says in caplog.text
    expected = torch_losses(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1), data)
    np.testing.assert_allclose(got, expected, rtol=1e-4)


# --- constants a trace reads: captured CPU tensors and masks folded while tracing --------------------------------


def test_a_captured_tensor_written_in_place_retraces_the_step_and_evaluate_as_eager_torch_reads_it(caplog):
    """Class weights captured from outside the model are a constant of the compiled step: after
    ``weights.copy_(...)`` the step and the evaluation are traced again, as eager torch reads them anew."""
    weights = torch.ones(3)
    loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1], weight=weights)  # noqa: E731
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    model = copy.deepcopy(ref)
    mesh = ts.make_mesh({"data": 2}, devices=jax.devices()[:2])
    trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), ts.plan(model, mesh))
    batches = [
        (torch.randn(4, 4, generator=torch.Generator().manual_seed(i)), torch.tensor([0, 1, 2, 0])) for i in range(4)
    ]
    news = {2: torch.tensor([5.0, 0.1, 0.1]), 3: torch.tensor([0.2, 3.0, 1.0])}
    got, evaluated, expected, eager_evaluated = [], [], [], []
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="torchshard"):
        for i, batch in enumerate(batches):
            if i in news:
                weights.copy_(news[i])
            evaluated.append(float(trainer.evaluate(batch)["loss"]))
            got.append(float(trainer.step(batch)["loss"]))
            with torch.no_grad():
                eager_evaluated.append(float(loss_fn(ref, batch)))
            expected.extend(torch_losses(ref, loss_fn, opt, [batch]))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_allclose(evaluated, eager_evaluated, rtol=1e-5)
    assert caplog.text.count("written in place since the step was traced: tracing the step again") == 2


def test_random_ops_on_masks_folded_while_tracing_draw_anew_each_step():
    """``torch.ones`` is computed while tracing (a mask of constants); dropout over it must still draw a new mask
    every step, as eager torch does, not one mask baked into the compiled step."""

    class Dropped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(64))

        def forward(self, x):
            return (self.w * x * torch.nn.functional.dropout(torch.ones(64), 0.5, training=True)).sum()

    model = Dropped()
    mesh = ts.make_mesh({"data": 2}, devices=jax.devices()[:2])
    trainer = ts.Trainer(model, lambda m, b: m(b), optax.sgd(0.0), ts.plan(model, mesh))
    x = torch.arange(128.0).reshape(2, 64)
    losses = {float(trainer.step(x)["loss"]) for _ in range(4)}
    assert len(losses) == 4, losses  # 4 masks of 64 coins each: equal ones would be a 2**-64 chance
