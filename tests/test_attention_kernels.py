"""Which kernel each attention call gets (`_bridge/ops/kernels.py`), per platform, and every kernel that runs on
the CPU against eager torch's SDPA: values and q/k/v gradients (fp32, tests/helpers.py's tolerance)."""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch.nn import functional as F

import torchshard as ts
from testsupport.helpers import assert_attention_matches, torch_losses
from testsupport.models import ids_loss, kernel_batches, kernel_llama
from torchshard._bridge.ops import kernels
from torchshard._bridge.ops.attention import fused_jax
from torchshard._bridge.ops.splash import splash_attention

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


def _call(q=(2, 8, 256, 64), k=(2, 2, 256, 64), v=None, dtype=BF16, **kw) -> kernels.Call:
    return kernels.Call("model.layers.0.self_attn", q, k, v or k, dtype, **kw)


# (call, platform, devices, the kernel auto picks, words of its reason)
AUTO = [
    (_call(causal=True), "gpu", 8, "cudnn", ""),
    (_call(mask="bool"), "gpu", 8, "cudnn", ""),
    (_call(dtype=F32), "gpu", 8, "tiled", "float32 inputs"),
    (_call(q=(2, 8, 256, 24), k=(2, 8, 256, 24), v=(2, 8, 256, 16)), "gpu", 8, "tiled", "values of head dim 16"),
    (_call(q=(2, 8, 256, 192), k=(2, 8, 256, 192)), "gpu", 8, "tiled", "head dim 192"),
    (_call(q=(2, 8, 1, 64), k=(2, 2, 256, 64), causal=True), "gpu", 8, "tiled", "1 queries and 256 keys"),
    (_call(dropout=True), "gpu", 8, "reference", "dropout"),
    (_call(causal=True), "tpu", 1, "splash", ""),
    (_call(causal=True), "tpu", 8, "tiled", "a mesh of 8 devices"),
    (_call(mask="float"), "tpu", 1, "tiled", "an attention mask tensor"),
    (_call(q=(2, 8, 200, 64), k=(2, 2, 200, 64)), "tpu", 1, "tiled", "multiples of 128"),
    (_call(causal=True), "cpu", 8, "tiled", "cpu: no fused attention kernel"),
    (_call(dropout=True), "cpu", 8, "reference", ""),
]


@pytest.mark.parametrize(("call", "platform", "devices", "kernel", "reason"), AUTO)
def test_auto_picks_the_fused_kernel_of_the_platform_where_it_takes_the_call(call, platform, devices, kernel, reason):
    choice = kernels.choose("auto", call, platform, devices=devices)
    assert choice.kernel == kernel and reason in choice.reason


@pytest.mark.parametrize(
    ("requested", "call", "platform", "match"),
    [
        (
            "cudnn",
            _call(),
            "cpu",
            r"'cudnn' cannot take the attention called by model.layers.0.self_attn .*runs on GPU",
        ),
        ("splash", _call(causal=True), "gpu", r"'splash' .*splash attention runs on TPUs; this step runs on gpu"),
        ("xla", _call(q=(2, 8, 256, 24), k=(2, 8, 256, 24), v=(2, 8, 256, 16)), "cpu", r"'xla' .*\(MLA\)"),
        ("cudnn", _call(dtype=F32), "gpu", r"float32 inputs .*use MixedPrecision"),
        ("tiled", _call(dropout=True), "cpu", r"dropout"),
        # where tokamax is missing, forcing it names that first (and Trainer/generate refuse it when built)
        ("tokamax", _call(dropout=True), "cpu", r"'tokamax' cannot take .*self_attn .*(dropout|pip install tokamax)"),
    ],
)
def test_a_forced_kernel_that_cannot_take_a_call_is_an_argument_error_naming_it(requested, call, platform, match):
    with pytest.raises(ts.ArgumentError, match=match):
        kernels.choose(requested, call, platform)


@pytest.mark.parametrize("requested", ["cudnn", "xla", "tiled", "splash"])
def test_a_forced_kernel_is_taken_where_it_can(requested):
    platform = {"cudnn": "gpu", "splash": "tpu"}.get(requested, "cpu")
    assert kernels.choose(requested, _call(causal=True), platform) == kernels.Choice(requested, "forced")


# ---------------------------------------------------------------- the kernels that run here, against eager SDPA

MASKS = {
    "none": None,
    "causal": "causal",
    "bool padding": (torch.arange(128) < torch.tensor([[100], [128]]))[:, None, None],
    "float bias": torch.randn(4, 128, 128, generator=torch.Generator().manual_seed(1)),
    "window of 20": torch.ones(128, 128, dtype=torch.bool).tril() & torch.ones(128, 128, dtype=torch.bool).triu(-19),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_xla_kernel_matches_torch_sdpa(mask, kv_heads):
    mesh = ts.make_mesh({"data": 2, "context": 1, "model": 4})
    g = torch.Generator().manual_seed(kv_heads)
    shapes = [(2, 4, 128, 16), (2, kv_heads, 128, 16), (2, kv_heads, 128, 16), (2, 4, 128, 16)]
    q, k, v, w = (torch.randn(s, generator=g) for s in shapes)
    causal, attn_mask = MASKS[mask] == "causal", MASKS[mask] if MASKS[mask] is not None and mask != "causal" else None

    def torch_fn(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal, enable_gqa=True) * w).sum()

    jax_mask = None if attn_mask is None else jnp.asarray(attn_mask.numpy())
    assert_attention_matches(lambda q, k, v: fused_jax("xla", q, k, v, jax_mask, causal, None), torch_fn, mesh,
                             q, k, v, w)  # fmt: skip


@pytest.mark.parametrize(("causal", "kv_heads"), [(True, 4), (True, 2), (False, 1)])
def test_splash_attention_interpreted_matches_torch_sdpa(causal, kv_heads):
    mesh = ts.make_mesh({"data": 2, "context": 1, "model": 4})
    g = torch.Generator().manual_seed(7)
    shapes = [(2, 4, 128, 16), (2, kv_heads, 128, 16), (2, kv_heads, 128, 16), (2, 4, 128, 16)]
    q, k, v, w = (torch.randn(s, generator=g) for s in shapes)

    def torch_fn(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True) * w).sum()

    attend = lambda q, k, v: splash_attention(q, k, v, causal=causal, interpret=True)  # noqa: E731
    assert_attention_matches(attend, torch_fn, mesh, q, k, v, w)


# ---------------------------------------------------------------- through the Trainer and generate


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["xla", "tiled"])
def test_a_tensor_parallel_llama_trains_like_eager_torch_on_a_forced_kernel(kernel):
    model = kernel_llama()
    ref = copy.deepcopy(model)
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    expected = torch_losses(ref, ids_loss, adamw, kernel_batches())
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.hf_rules(model))
    trainer = ts.Trainer(model, ids_loss, optax.adamw(1e-3, weight_decay=0.01), plan, attention_kernel=kernel)
    np.testing.assert_allclose([float(trainer.step(b)["loss"]) for b in kernel_batches()], expected, rtol=1e-4)
    assert trainer.kernels == {f"model.layers.{i}.self_attn": kernels.Choice(kernel, "forced") for i in range(2)}


@pytest.mark.slow
def test_the_kernels_say_what_auto_picked_and_the_context_parallel_ring_says_so():
    model = kernel_llama()
    plan = ts.plan(model, ts.make_mesh({"data": 2, "context": 4}))
    trainer = ts.Trainer(model, ids_loss, optax.adamw(1e-3), plan)
    trainer.step(kernel_batches()[0])
    assert {str(c) for c in trainer.kernels.values()} == {"tiled (cpu: no fused attention kernel there)"}
    ring = ts.Trainer(kernel_llama(), ids_loss, optax.adamw(1e-3), plan, batch_spec=("data", "context"),
                      context=ts.ContextParallel())  # fmt: skip
    ring.step(kernel_batches()[0])
    assert [c.kernel for c in ring.kernels.values()] == ["ring", "ring"]
    forced = ts.Trainer(kernel_llama(), ids_loss, optax.adamw(1e-3), plan, batch_spec=("data", "context"),
                        context=ts.ContextParallel(), attention_kernel="xla")  # fmt: skip
    with pytest.raises(ts.ArgumentError, match=r"'xla' cannot take .*each device folds its part .* with the ring"):
        forced.step(kernel_batches()[0])
    assert forced.step_count == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attention_kernel": "flash"}, r"attention_kernel must be one of 'auto', 'cudnn', 'splash', 'xla', 'tiled', "),
        ({"attention_kernel": 3}, r"attention_kernel must be one of .*'tiled', 'tokamax', got 3"),
    ],
)
def test_a_bad_kernel_name_is_refused_by_the_trainer_and_generate(kwargs, match):
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    plan = ts.plan(model, ts.make_mesh({"data": 8}))
    with pytest.raises(ts.ArgumentError, match=match):
        ts.Trainer(model, lambda m, b: m(b).sum(), optax.sgd(0.1), plan, **kwargs)
    placed = ts.shard(model, plan)
    with pytest.raises(ts.ArgumentError, match=match):
        ts.generate(placed, torch.tensor([[1, 2, 3]]), max_new_tokens=2, **kwargs)


@pytest.mark.slow
def test_generate_on_a_forced_kernel_equals_eager_and_a_kernel_it_cannot_take_is_named():
    model = kernel_llama().eval()
    prompts = kernel_batches()[0][:4, :6]
    with torch.no_grad():
        expected = model.generate(prompts, max_new_tokens=5, do_sample=False)
    placed = ts.shard(copy.deepcopy(model), ts.plan(model, ts.make_mesh({"data": 8})))
    assert torch.equal(ts.generate(placed, prompts, max_new_tokens=5, attention_kernel="xla"), expected)
    with pytest.raises(ts.ArgumentError, match=r"attention_kernel='cudnn' cannot take .*runs on GPUs"):
        ts.generate(placed, prompts, max_new_tokens=5, attention_kernel="cudnn")
