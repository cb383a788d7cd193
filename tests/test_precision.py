"""MixedPrecision: fp32 master weights and optimizer state, bf16 compute, against an eager-torch policy twin."""

from __future__ import annotations

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import torchshard as ts
from testsupport.models import BlockStack, tiny_llama
from testsupport.precision import LR, RTOL, WD, blocks_loss, torch_mixed_precision
from torchshard import presets


def llama_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


MODELS = {"blocks": (lambda: BlockStack(depth=3), blocks_loss, 64), "llama": (lambda: tiny_llama(), llama_loss, 128)}


def batches(vocab, n=6):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (8, 12), generator=g) for _ in range(n)]


def trainer_for(model, loss_fn, *, mesh=None, **kwargs):
    mesh = mesh or ts.make_mesh({"data": 4, "model": 2})
    plan = ts.plan(model, mesh, presets.fsdp(min_size=256))
    return ts.Trainer(model, loss_fn, optax.adamw(LR, weight_decay=WD), plan, **kwargs)


@pytest.mark.parametrize(("name", "scan"), [("blocks", False), ("llama", True)])
@pytest.mark.slow
def test_losses_match_an_eager_torch_twin_of_the_policy(name, scan):
    factory, loss_fn, vocab = MODELS[name]
    data = batches(vocab)
    torch.manual_seed(0)
    expected = torch_mixed_precision(factory(), loss_fn, data)
    torch.manual_seed(0)
    trainer = trainer_for(factory(), loss_fn, precision=ts.MixedPrecision(), scan_layers=scan)
    got = np.array([float(trainer.step(b)["loss"]) for b in data])
    np.testing.assert_allclose(got, expected, rtol=RTOL)


def _dots(text: str) -> list[tuple[str, str]]:
    return re.findall(r"stablehlo\.dot_general.*?:\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)", text)


@pytest.mark.slow
def test_master_state_is_float32_and_nine_in_ten_dots_are_bf16():
    torch.manual_seed(0)
    trainer = trainer_for(tiny_llama(), llama_loss, precision=ts.MixedPrecision())
    batch = batches(128, n=1)[0]
    dots = _dots(trainer.lower(batch).as_text())
    bf16 = [pair for pair in dots if all("bf16" in t for t in pair)]
    assert len(dots) > 20 and len(bf16) >= 0.9 * len(dots), f"{len(bf16)} of {len(dots)} dot_generals are bf16"
    trainer.step(batch)
    floating = [x for x in jax.tree.leaves(trainer.state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert {x.dtype for x in floating} == {jnp.dtype("float32")}
    exported = ts.to_torch_state_dict(trainer)
    assert {t.dtype for t in exported.values() if t.is_floating_point()} == {torch.float32}


# the float32 matmuls a bf16 step may keep: those of the loss (its softmax runs in float32) and of norms
FLOAT32_ALLOWED = re.compile(r"linear_cross_entropy|cross_entropy|norm", re.I)


@pytest.mark.slow
@pytest.mark.parametrize("fused_loss", [True, False])
def test_a_bf16_llama_step_has_no_float32_matmul_outside_the_loss_and_the_norms(fused_loss):
    # read from the traced step: XLA:CPU converts bf16 matmuls to float32 when it compiles
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    mesh = ts.make_mesh({"data": 4, "model": 2})
    trainer = ts.Trainer(model, lambda m, ids: m(input_ids=ids, labels=ids).loss, optax.adamw(1e-3),
                         ts.plan(model, mesh, presets.hf_rules(model)), precision=ts.MixedPrecision(),
                         fused_loss=fused_loss)  # fmt: skip
    found = ts.inspect.matmuls(trainer, torch.randint(0, 512, (8, 256)))
    stray = [m for m in found if m.float32 and not FLOAT32_ALLOWED.search(m.scope)]
    assert len(found) > 40 and stray == [], stray


def test_without_a_policy_no_dot_is_bf16():
    torch.manual_seed(0)
    trainer = trainer_for(tiny_llama(), llama_loss)
    assert not any("bf16" in a + b for a, b in _dots(trainer.lower(batches(128, n=1)[0]).as_text()))


class Counter(BlockStack):
    """A BlockStack with an integer buffer, which no precision policy may cast."""

    def __init__(self):
        super().__init__(depth=2)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int32))

    def forward(self, ids):
        self.seen.add_(1)
        return super().forward(ids)


def test_a_bf16_model_gets_float32_masters_and_integer_buffers_stay_integers():
    torch.manual_seed(0)
    model = Counter().to(torch.bfloat16)
    trainer = trainer_for(model, blocks_loss, precision=ts.MixedPrecision())
    for batch in batches(64, n=2):
        trainer.step(batch)
    assert trainer.state.params["embed.weight"].dtype == jnp.float32
    assert trainer.state.buffers["seen"].dtype == jnp.int32 and int(trainer.state.buffers["seen"]) == 2
    assert ts.to_torch_state_dict(trainer)["head.weight"].dtype == torch.float32


def test_a_bf16_model_without_a_policy_trains_in_bf16_like_torch():
    data = batches(64, n=4)
    torch.manual_seed(0)
    ref = BlockStack(depth=2).to(torch.bfloat16)
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    expected = []
    for b in data:
        loss = blocks_loss(ref, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    plan = ts.plan(model, ts.make_mesh({"data": 8}), presets.fsdp(min_size=256))
    trainer = ts.Trainer(model, blocks_loss, optax.sgd(0.5), plan)
    got = [float(trainer.step(b)["loss"]) for b in data]
    assert trainer.state.params["embed.weight"].dtype == jnp.bfloat16
    np.testing.assert_allclose(got, expected, rtol=2e-2)  # bf16 parameters: 8 mantissa bits
    assert got[-1] < got[0]


@pytest.mark.slow
def test_torch_autocast_in_the_loss_takes_effect():
    def autocast_loss(model, ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return blocks_loss(model, ids)

    torch.manual_seed(0)
    plain = trainer_for(BlockStack(depth=2), blocks_loss)
    torch.manual_seed(0)
    cast = trainer_for(BlockStack(depth=2), autocast_loss)
    batch = batches(64, n=1)[0]
    assert any("bf16" in a and "bf16" in b for a, b in _dots(cast.lower(batch).as_text()))
    a, b = float(plain.step(batch)["loss"]), float(cast.step(batch)["loss"])
    assert a != b and abs(a - b) < 1e-2 * abs(a)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ts.MixedPrecision(compute_dtype=torch.int32), r"compute_dtype=torch\.int32 must be a floating"),
        (lambda: ts.MixedPrecision(param_dtype="float32"), r"param_dtype='float32' must be a floating torch dtype"),
        (lambda: ts.MixedPrecision(cast_inputs="yes"), r"cast_inputs='yes' must be True or False"),
        (
            lambda: trainer_for(BlockStack(depth=2), blocks_loss, precision="bf16"),
            r"precision must be None or a torchshard\.MixedPrecision, got str",
        ),
    ],
    ids=["int-compute", "string-dtype", "cast-inputs", "not-a-policy"],
)
def test_bad_policies_are_argument_errors(make, match):
    with pytest.raises(TypeError, match=match):
        make()
