"""Multi-head latent attention, whose values are narrower than its queries and keys, like eager torch.

DeepSeek-V3 attends with queries and keys of 192 (128 without rotary + 64 with) and values of 128;
GLM-4-MoE-lite likewise. Here 16 + 8 = 24 against 16, the same 3:2. Every attention path meets it:
the tiled kernel (training), the context-parallel ring, and generate's prefill and cache.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import optax
import pytest
import torch

import torchshard as ts
from testsupport.helpers import torch_losses
from tools.families import build, family, lm_loss
from torchshard import presets

pytestmark = pytest.mark.slow  # real transformers models, a compile each
RTOL = 1e-4  # fp32 AdamW losses, as tests/test_families.py
LR = 1e-3
MLA_TYPES = ("deepseek_v3", "glm4_moe_lite")


def _model(model_type: str) -> torch.nn.Module:
    base = family(model_type)
    mla = (("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8), ("v_head_dim", 16))
    model = build(dataclasses.replace(base, extra=(*base.extra, *mla)))
    config = model.config
    assert config.qk_nope_head_dim + config.qk_rope_head_dim != config.v_head_dim
    return model


def _batches(rows: int = 8, seq: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 128, (rows, seq), generator=g) for _ in range(3)]


def _trained(model: torch.nn.Module, axes: dict[str, int], **kwargs) -> list[float]:
    plan = ts.plan(model, ts.make_mesh(axes), presets.fsdp("data", min_size=256))
    trainer = ts.Trainer(model, lm_loss, optax.adamw(LR, weight_decay=0.01), plan, **kwargs)
    return [float(trainer.step(b)["loss"]) for b in _batches()]


def _eager(model: torch.nn.Module) -> list[float]:
    return torch_losses(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), _batches())


@pytest.mark.parametrize("model_type", MLA_TYPES)
def test_mla_trains_like_eager_torch(model_type):
    model = _model(model_type)
    expected = _eager(copy.deepcopy(model))
    np.testing.assert_allclose(_trained(model, {"data": 8}), expected, rtol=RTOL)


@pytest.mark.parametrize("attention", ["ring", "all_gather"])
def test_mla_trains_context_parallel_like_eager_torch(attention):
    model = _model("deepseek_v3")
    expected = _eager(copy.deepcopy(model))
    got = _trained(model, {"data": 2, "context": 4}, batch_spec=("data", "context"),
                   context=ts.ContextParallel(attention=attention))  # fmt: skip
    np.testing.assert_allclose(got, expected, rtol=RTOL)


@pytest.mark.parametrize("model_type", MLA_TYPES)
def test_mla_generates_what_eager_transformers_generates(model_type):
    model = _model(model_type).eval()
    prompts = _batches(rows=4, seq=5)[0]
    placed = ts.shard(copy.deepcopy(model), ts.plan(model, ts.make_mesh({"data": 8})))
    with torch.no_grad():
        expected = model.generate(prompts, max_new_tokens=6, do_sample=False)
    assert torch.equal(ts.generate(placed, prompts, max_new_tokens=6), expected)
