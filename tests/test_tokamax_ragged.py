"""tokamax's ``ragged_dot`` for the experts' grouped matmul under ``attention_kernel="tokamax"``.

Which implementation a call gets is tested per platform with the platform forced; every other option
keeps ``jax.lax.ragged_dot``. The probe's fallback is tested on the CPU by making its runner fail,
with tokamax stood in by ``jax.lax.ragged_dot`` (no tokamax needed). Where tokamax is installed
(Python >= 3.12, jax >= 0.11.1) its XLA implementation is tested against eager torch's
``_grouped_mm`` (values and gradients, tests/helpers.py's tolerance, test_moe_ops.py's cases), and a
tiny Mixtral (its real config's relations: top-2 of 8 experts) trains like eager torch on it.
"""

from __future__ import annotations

import copy
import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torchax.interop
from test_moe_ops import CASES, IDS

import torchshard as ts
from testsupport.helpers import TOKAMAX_NEEDS, assert_close, eager_value_and_grads, torch_losses
from torchshard._bridge.ops import kernels, tokamax_attention, tokamax_ragged

F32 = np.dtype("float32")
SITE = "model.layers.0.mlp.experts"

pytestmark = pytest.mark.usefixtures("fresh_probes")


def _failing(*names: str):
    return lambda kernel: "RuntimeError: injected" if kernel in names else None


CALL = tokamax_ragged.GroupedCall(SITE, 512, 8, 64, 128, F32, F32)
INJECTED = "failed its probe (RuntimeError: injected)"
PALLAS_ON_8 = (
    "mosaic, triton: a mesh of 8 devices (a Pallas kernel runs per device; torchshard does not shard_map it yet)"
)
ON_CPU = "mosaic, triton: Pallas kernels for GPUs and TPUs; this step runs on cpu"
ALL = tuple(f"tokamax:{i}" for i in tokamax_ragged.IMPLEMENTATIONS)

# (requested, platform, devices, what fails its probe, the choice)
CHOICES = [
    ("auto", "gpu", 1, (), "ragged_dot"),
    ("cudnn", "gpu", 1, (), "ragged_dot"),
    ("tokamax", "cpu", 8, (), f"tokamax:xla (forced; {ON_CPU})"),
    ("tokamax", "gpu", 1, (), "tokamax:mosaic (forced)"),
    ("tokamax", "gpu", 1, ("tokamax:mosaic",), f"tokamax:triton (forced; mosaic: {INJECTED})"),
    ("tokamax", "tpu", 1, (), "tokamax:mosaic (forced)"),
    (
        "tokamax",
        "tpu",
        1,
        ("tokamax:mosaic",),
        f"tokamax:xla (forced; mosaic: {INJECTED}; triton: a GPU kernel; this step runs on tpu)",
    ),
    ("tokamax", "gpu", 8, (), f"tokamax:xla (forced; {PALLAS_ON_8})"),
    ("tokamax", "gpu", 1, ALL, f"ragged_dot (tokamax: mosaic, triton, xla: {INJECTED})"),
]


@pytest.mark.parametrize(("requested", "platform", "devices", "failing", "expected"), CHOICES)
def test_tokamax_takes_its_first_ragged_dot_that_takes_the_call_and_passes_its_probe(
    tokamax_installed, requested, platform, devices, failing, expected
):
    choice = tokamax_ragged.choose(requested, CALL, platform, devices=devices, probe=_failing(*failing))
    assert str(choice) == expected


def test_without_tokamax_the_grouped_matmul_is_jaxs_saying_why(monkeypatch):
    monkeypatch.setattr(tokamax_attention, "missing", lambda: "tokamax cannot be imported (...)")
    assert tokamax_ragged.choose("tokamax", CALL, "gpu") == kernels.Choice(
        "ragged_dot", "tokamax cannot be imported (...)"
    )


# ---------------------------------------------------------------- through the lowering on the CPU

EXPERTS = [case for case in CASES if case[0].startswith(("2d_3d", "3d_2d"))]


def _lowered(requested: str, fn, inputs, argnums):
    """``fn``'s value and gradients through torchshard's lowering under ``requested``, and the recorded choice."""
    record: dict[str, kernels.Choice] = {}
    with kernels.choosing(kernels.Policy(requested, "cpu", 1, record)):
        got = jax.jit(jax.value_and_grad(torchax.interop.jax_view(fn), argnums=argnums))(
            *(jnp.asarray(t.numpy()) for t in inputs)
        )
    return got, record[""]


def _assert_matches(got, fn, inputs, argnums, rows, what: str) -> None:
    want, want_grads = eager_value_and_grads(fn, inputs, argnums)
    value, grads = got
    assert_close(value, want, what=what)
    for i, grad, expected in zip(argnums, grads, want_grads, strict=True):
        if i == 0 and rows is not None:
            grad, expected = grad[:rows], expected[:rows]
        assert_close(grad, expected, what=f"{what} grad {i}")


def _garbage_past_the_groups(lhs, rhs, group_sizes, preferred_element_type, implementation, shift=0.0):
    """tokamax's ragged_dot stood in by ``jax.lax.ragged_dot``, leaving nan in the rows past the last group (as a
    kernel may leave them unwritten), and off by ``shift``."""
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type) + shift
    return jnp.where(jnp.arange(lhs.shape[0])[:, None] < jnp.sum(group_sizes), out, jnp.nan)


@pytest.fixture
def stand_in(tokamax_installed, monkeypatch):
    """A stand-in tokamax module (`_garbage_past_the_groups`): runs where tokamax is not installed."""
    module = types.SimpleNamespace(ragged_dot=_garbage_past_the_groups)
    monkeypatch.setitem(sys.modules, "tokamax", module)
    return module


def test_an_injected_probe_failure_falls_back_to_jaxs_ragged_dot_with_its_reason(stand_in, monkeypatch):
    real = tokamax_ragged.run_case
    monkeypatch.setattr(
        tokamax_ragged, "run_case", lambda dot, *a: real(dot, *a) if dot is tokamax_ragged.lax_dot else 1 / 0
    )
    _, fn, inputs, argnums, rows = EXPERTS[0]
    got, choice = _lowered("tokamax", fn, inputs, argnums)
    reason = f"tokamax: {ON_CPU}; xla: failed its probe (running a tiny case: ZeroDivisionError: division by zero)"
    assert choice == kernels.Choice("ragged_dot", reason)
    _assert_matches(got, fn, inputs, argnums, rows, "the fallback")


def test_a_ragged_dot_whose_tiny_case_is_wrong_fails_its_probe(stand_in, monkeypatch):
    monkeypatch.setattr(stand_in, "ragged_dot", functools.partial(_garbage_past_the_groups, shift=1e3))
    _, choice = _lowered("tokamax", *EXPERTS[0][1:4])
    assert choice.kernel == "ragged_dot" and "xla: failed its probe (a tiny case is off by" in choice.reason, choice


def test_rows_past_the_last_group_are_zero_whatever_the_kernel_leaves_there(stand_in):
    name, fn, inputs, argnums, rows = next(case for case in EXPERTS if case[0] == "2d_3d_rows_beyond_last_offset")
    got, choice = _lowered("tokamax", fn, inputs, argnums)
    assert choice == kernels.Choice("tokamax:xla", f"forced; {ON_CPU}")
    _assert_matches(got, fn, inputs, argnums, rows, name)
    lhs, rhs, offs = (jnp.asarray(t.numpy()) for t in inputs[:3])
    with kernels.choosing(kernels.Policy("tokamax", "cpu", 1, {})):
        out = jax.jit(torchax.interop.jax_view(torch._grouped_mm))(lhs, rhs, offs=offs)
    assert float(jnp.abs(out[int(offs[-1]) :]).max()) == 0.0


@pytest.mark.parametrize(("name", "fn", "inputs", "argnums", "rows"), EXPERTS, ids=[c[0] for c in EXPERTS])
def test_tokamax_ragged_dot_matches_eager_torchs_grouped_mm(name, fn, inputs, argnums, rows):
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    got, choice = _lowered("tokamax", fn, inputs, argnums)
    assert choice == kernels.Choice("tokamax:xla", f"forced; {ON_CPU}")
    _assert_matches(got, fn, inputs, argnums, rows, name)


def test_the_cases_cover_every_experts_form():
    assert {c[0] for c in EXPERTS} == {i for i in IDS if i.startswith(("2d_3d", "3d_2d"))}


# ---------------------------------------------------------------- a tiny MoE family in a Trainer


def _mixtral():
    from tools.families import build, family

    return build(family("mixtral"))  # top-2 of 8 experts, transformers' grouped_mm experts


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (8, 16), generator=g) for _ in range(3)]


def _loss(m, ids):
    return m(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.slow
def test_a_tiny_mixtral_trains_like_eager_torch_on_tokamaxs_ragged_dot():
    pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    model = _mixtral()
    assert model.config._experts_implementation == "grouped_mm"
    ref = copy.deepcopy(model)
    expected = torch_losses(ref, _loss, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01), _batches())
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.hf_rules(model))
    trainer = ts.Trainer(model, _loss, optax.adamw(1e-3, weight_decay=0.01), plan, attention_kernel="tokamax")
    np.testing.assert_allclose([float(trainer.step(b)["loss"]) for b in _batches()], expected, rtol=1e-4)
    experts = {site: choice for site, choice in trainer.kernels.items() if site.endswith("experts")}
    assert experts == {f"model.layers.{i}.mlp.experts": kernels.Choice("tokamax:xla", f"forced; {ON_CPU}")
                       for i in range(2)}  # fmt: skip
