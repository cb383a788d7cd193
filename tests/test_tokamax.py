"""``attention_kernel="tokamax"`` and the probe every library attention kernel passes before its first use.

Which of tokamax's implementations a call gets (its own order: Mosaic GPU, Triton, cuDNN, XLA) is
tested per platform with the platform forced; the probe's fallback is tested on the CPU by making its
runner fail (no tokamax needed); tokamax's XLA implementation is tested against eager torch's SDPA
(values and q/k/v gradients, tests/helpers.py's tolerance) where tokamax is installed (Python >= 3.12,
jax >= 0.11.1), and skipped with that reason elsewhere. The adversarial calls of
test_attention_adversaries.py run on it there too.
"""

from __future__ import annotations

import copy
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torchax.interop
from torch.nn import functional as F

import torchshard as ts
from testsupport.helpers import (
    TOKAMAX_NEEDS,
    assert_attention_matches,
    assert_close,
    eager_value_and_grads,
    torch_losses,
)
from testsupport.models import ids_loss, kernel_batches, kernel_llama
from torchshard._bridge.ops import kernels, probes, tokamax_attention

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)

pytestmark = pytest.mark.usefixtures("fresh_probes")


def _call(q=(2, 8, 256, 64), k=(2, 2, 256, 64), v=None, dtype=BF16, **kw) -> kernels.Call:
    return kernels.Call("model.layers.0.self_attn", q, k, v or k, dtype, **kw)


def _failing(*names: str):
    return lambda kernel: "RuntimeError: injected" if kernel in names else None


ALL_TOKAMAX = tuple(f"tokamax:{i}" for i in tokamax_attention.IMPLEMENTATIONS)

INJECTED = "failed its probe (RuntimeError: injected)"
ON_GPUS = "mosaic, triton, cudnn: GPU kernels; this step runs on"
PALLAS_ON_8 = (
    "mosaic, triton: a mesh of 8 devices (a Pallas kernel runs per device; torchshard does not shard_map it yet)"
)
FLOAT32 = "cudnn: float32 inputs (cuDNN's flash attention takes bf16/fp16: use MixedPrecision)"
CPU = "cpu: no fused attention kernel there"

# (call, platform, devices, what fails its probe, the choice)
TOKAMAX = [
    (_call(causal=True), "cpu", 8, (), f"tokamax:xla (forced; {ON_GPUS} cpu)"),
    (_call(causal=True), "gpu", 1, (), "tokamax:mosaic (forced)"),
    (_call(causal=True), "gpu", 1, ("tokamax:mosaic",), f"tokamax:triton (forced; mosaic: {INJECTED})"),
    (_call(causal=True), "gpu", 8, (), f"tokamax:cudnn (forced; {PALLAS_ON_8})"),
    (_call(dtype=F32), "gpu", 8, (), f"tokamax:xla (forced; {PALLAS_ON_8}; {FLOAT32})"),
    (_call(causal=True), "tpu", 1, (), f"tokamax:xla (forced; {ON_GPUS} tpu)"),
    (_call(causal=True), "gpu", 1, ALL_TOKAMAX, f"cudnn (tokamax: mosaic, triton, cudnn, xla: {INJECTED})"),
    (_call(causal=True), "cpu", 1, ALL_TOKAMAX, f"tiled (tokamax: {ON_GPUS} cpu; xla: {INJECTED}; {CPU})"),
]


@pytest.mark.parametrize(("call", "platform", "devices", "failing", "expected"), TOKAMAX)
def test_tokamax_takes_its_first_implementation_that_takes_the_call_and_passes_its_probe(
    tokamax_installed, call, platform, devices, failing, expected
):
    assert str(kernels.choose("tokamax", call, platform, devices=devices, probe=_failing(*failing))) == expected


# (requested, call, platform, what fails its probe, the choice): a failed probe falls back to auto's choice
FALLBACKS = [
    ("xla", _call(causal=True), "cpu", ("xla",), f"tiled (xla {INJECTED}; {CPU})"),
    ("cudnn", _call(causal=True), "gpu", ("cudnn",), f"tiled (cudnn {INJECTED})"),
    ("auto", _call(causal=True), "gpu", ("cudnn",), f"tiled (cudnn {INJECTED})"),
    ("auto", _call(causal=True), "tpu", ("splash",), f"tiled (splash {INJECTED})"),
    ("splash", _call(causal=True), "tpu", ("splash",), f"tiled (splash {INJECTED})"),
    ("xla", _call(causal=True), "cpu", ("cudnn",), "xla (forced)"),
]


@pytest.mark.parametrize(("requested", "call", "platform", "failing", "expected"), FALLBACKS)
def test_a_kernel_that_fails_its_probe_falls_back_to_autos_choice_with_the_reason(
    requested, call, platform, failing, expected
):
    assert str(kernels.choose(requested, call, platform, probe=_failing(*failing))) == expected


def test_a_missing_tokamax_is_refused_when_the_trainer_is_built_and_when_generate_is_called(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # `import tokamax` raises ImportError, as where it is absent
    tokamax_attention.missing.cache_clear()
    try:
        model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
        plan = ts.plan(model, ts.make_mesh({"data": 8}))
        match = (
            r"attention_kernel='tokamax' cannot run here: tokamax cannot be imported "
            r".*tokamax needs Python >= 3.12 and jax >= 0.11.1 .*: pip install tokamax"
        )
        with pytest.raises(ts.ArgumentError, match=match):
            ts.Trainer(model, lambda m, b: m(b).sum(), optax.sgd(0.1), plan, attention_kernel="tokamax")
        with pytest.raises(ts.ArgumentError, match=match):
            ts.generate(ts.shard(model, plan), torch.tensor([[1, 2, 3]]), max_new_tokens=2, attention_kernel="tokamax")
    finally:
        tokamax_attention.missing.cache_clear()


def test_forced_tokamax_refuses_dropout_by_name(tokamax_installed):
    with pytest.raises(ts.ArgumentError, match=r"attention_kernel='tokamax' cannot take .*self_attn .*dropout"):
        kernels.choose("tokamax", _call(dropout=True), "gpu")


# ---------------------------------------------------------------- the probe, through the lowering on the CPU


def _grads(kernel: str, causal: bool = True, mask=None, shapes=((2, 4, 8, 8), (2, 2, 8, 8))):
    """The SDPA call's value and q/k/v gradients through torchshard's lowering, and eager torch's, and the choice."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in (shapes[0], shapes[1], shapes[1]))
    weight = torch.randn(shapes[0], generator=g)

    def fn(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=True)
        return (out * weight).sum()

    record: dict[str, kernels.Choice] = {}
    with kernels.choosing(kernels.Policy(kernel, "cpu", 1, record)):
        got = jax.jit(jax.value_and_grad(torchax.interop.jax_view(fn), argnums=(0, 1, 2)))(
            *(jnp.asarray(x.numpy()) for x in (q, k, v))
        )
    return got, eager_value_and_grads(fn, [q, k, v], argnums=(0, 1, 2)), record[""]


def _assert_same(got, expected, what: str) -> None:
    (value, grads), (want, want_grads) = got, expected
    assert_close(value, want, what=what)
    for name, a, b in zip("qkv", grads, want_grads, strict=True):
        assert_close(a, b, what=f"d{name}, {what}")


def test_an_injected_probe_failure_falls_back_to_the_tiled_kernel_on_the_cpu_with_its_reason(monkeypatch):
    real = probes.run_case

    def broken(form, inputs, causal):
        if form is not probes.dense:
            raise RuntimeError("injected")
        return real(form, inputs, causal)

    monkeypatch.setattr(probes, "run_case", broken)
    got, expected, choice = _grads("xla")
    assert choice == kernels.Choice(
        "tiled", f"xla failed its probe (running a tiny case: RuntimeError: injected); {CPU}"
    )
    _assert_same(got, expected, "the fallback")


def test_a_kernel_whose_tiny_case_is_wrong_fails_its_probe(monkeypatch):
    real = probes.run_case

    def off(form, inputs, causal):
        value, grads = real(form, inputs, causal)
        return (value if form is probes.dense else value + 1e3), grads

    monkeypatch.setattr(probes, "run_case", off)
    _, _, choice = _grads("xla")
    assert choice.kernel == "tiled" and "a tiny case is off by" in choice.reason, choice


def test_the_tiny_case_runs_once_per_platform_kernel_and_signature(monkeypatch):
    real, runs = probes.run_case, []

    def counted(form, inputs, causal):
        runs.append(form is probes.dense)
        return real(form, inputs, causal)

    monkeypatch.setattr(probes, "run_case", counted)
    for _ in range(2):
        assert _grads("xla")[2] == kernels.Choice("xla", "forced")
    _grads("xla", shapes=((2, 4, 16, 8), (2, 2, 16, 8)))  # same signature, longer sequences: no new run
    assert runs == [False, True]
    _grads("xla", causal=False)  # another signature
    assert runs == [False, True, False, True]


# ---------------------------------------------------------------- tokamax's XLA implementation, where installed

MASKS = {
    "none": None,
    "causal": "causal",
    "bool padding": (torch.arange(128) < torch.tensor([[100], [128]]))[:, None, None],
    "float bias": torch.randn(4, 128, 128, generator=torch.Generator().manual_seed(1)),
    "window of 20": torch.ones(128, 128, dtype=torch.bool).tril() & torch.ones(128, 128, dtype=torch.bool).triu(-19),
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_tokamax_xla_matches_torch_sdpa_with_heads_sharded(mask, kv_heads):
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    mesh = ts.make_mesh({"data": 2, "context": 1, "model": 4})
    g = torch.Generator().manual_seed(kv_heads)
    shapes = [(2, 4, 128, 16), (2, kv_heads, 128, 16), (2, kv_heads, 128, 16), (2, 4, 128, 16)]
    q, k, v, w = (torch.randn(s, generator=g) for s in shapes)
    causal, attn_mask = MASKS[mask] == "causal", MASKS[mask] if MASKS[mask] is not None and mask != "causal" else None

    def torch_fn(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal, enable_gqa=True) * w).sum()

    jax_mask = None if attn_mask is None else jnp.asarray(attn_mask.numpy())
    attend = lambda q, k, v: tokamax_attention.attend("xla", q, k, v, jax_mask, causal, None)  # noqa: E731
    assert_attention_matches(attend, torch_fn, mesh, q, k, v, w)


def test_tokamax_through_the_lowering_matches_eager_and_says_which_implementation_ran():
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    got, expected, choice = _grads("tokamax")
    assert choice == kernels.Choice("tokamax:xla", f"forced; {ON_GPUS} cpu")
    _assert_same(got, expected, "tokamax:xla")


def test_tokamax_whose_xla_implementation_fails_its_probe_falls_back_to_autos_choice(monkeypatch):
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    real = probes.run_case
    monkeypatch.setattr(probes, "run_case", lambda form, *a: real(form, *a) if form is probes.dense else 1 / 0)
    got, expected, choice = _grads("tokamax")
    assert choice.kernel == "tiled" and "xla: failed its probe (running a tiny case: ZeroDivisionError" in choice.reason
    _assert_same(got, expected, "the fallback")


@pytest.mark.slow
def test_a_tensor_parallel_llama_trains_like_eager_torch_on_tokamax():
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    model = kernel_llama()
    ref = copy.deepcopy(model)
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    expected = torch_losses(ref, ids_loss, adamw, kernel_batches())
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.hf_rules(model))
    trainer = ts.Trainer(model, ids_loss, optax.adamw(1e-3, weight_decay=0.01), plan, attention_kernel="tokamax")
    np.testing.assert_allclose([float(trainer.step(b)["loss"]) for b in kernel_batches()], expected, rtol=1e-4)
    assert {str(c) for c in trainer.kernels.values()} == {f"tokamax:xla (forced; {ON_GPUS} cpu)"}


@pytest.mark.slow
def test_a_trainer_whose_kernel_fails_its_probe_trains_like_eager_torch_on_the_fallback(monkeypatch):
    monkeypatch.setattr(probes, "run_case", lambda *a: 1 / 0)
    model = kernel_llama()
    ref = copy.deepcopy(model)
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    expected = torch_losses(ref, ids_loss, adamw, kernel_batches())
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.hf_rules(model))
    trainer = ts.Trainer(model, ids_loss, optax.adamw(1e-3, weight_decay=0.01), plan, attention_kernel="xla")
    np.testing.assert_allclose([float(trainer.step(b)["loss"]) for b in kernel_batches()], expected, rtol=1e-4)
    reason = f"xla failed its probe (running a tiny case: ZeroDivisionError: division by zero); {CPU}"
    assert trainer.kernels == {f"model.layers.{i}.self_attn": kernels.Choice("tiled", reason) for i in range(2)}
