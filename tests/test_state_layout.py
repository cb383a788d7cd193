"""AbstractTrainer and Trainer lay out the train state from one function: equal shardings and compiled bytes."""

from __future__ import annotations

import jax
import optax
import pytest
import torch
from test_context import CausalLM
from test_context import lm_loss as pair_loss
from test_expert_dispatch import mse
from test_pipeline import blocks_loss

import torchshard as ts
from testsupport.models import BlockStack, tiny_llama
from testsupport.models import MoEStack as MoEModel
from torchshard import ContextParallel, MixedPrecision, Pipeline, presets
from torchshard.inspect import AbstractTrainer


def llama_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _ids(vocab, rows, seq):
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))


def _pairs(vocab, rows, seq):
    ids = _ids(vocab, rows, seq + 1)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _moe_batch(rows, seq):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, seq, 16, generator=g), torch.randn(rows, seq, 16, generator=g)


# name: (model factory, mesh, rules(model), loss, batch, Trainer options)
CONFIGS = {
    "fsdp×tp": (lambda: tiny_llama(), {"data": 4, "model": 2}, presets.hf_rules, llama_loss,
                lambda: _ids(128, 8, 16), {}),
    "scan+remat+mixed": (lambda: tiny_llama(layers=3), {"data": 8}, lambda m: presets.fsdp(min_size=256), llama_loss,
                         lambda: _ids(128, 8, 16), {"scan_layers": True, "remat": r"model\.layers\.\d+",
                                                   "precision": MixedPrecision()}),
    "gpipe": (lambda: BlockStack(depth=8), {"stage": 4, "data": 2}, lambda m: presets.fsdp(min_size=256), blocks_loss,
              lambda: _ids(64, 8, 12), {"pipeline": Pipeline(microbatches=4)}),
    "circular": (lambda: BlockStack(depth=8), {"stage": 2, "data": 4}, lambda m: presets.fsdp(min_size=256),
                 blocks_loss, lambda: _ids(64, 8, 12),
                 {"pipeline": Pipeline(microbatches=2, schedule="circular", repeats=2)}),
    "context": (lambda: CausalLM(), {"data": 2, "context": 4}, lambda m: presets.fsdp(min_size=256), pair_loss,
                lambda: _pairs(64, 4, 32), {"context": ContextParallel(), "batch_spec": ("data", "context")}),
    "experts": (lambda: MoEModel(), {"data": 2, "expert": 4},
                lambda m: presets.expert_parallel([r".*experts\.(up|down)"], "expert"), mse,
                lambda: _moe_batch(16, 4), {"batch_spec": (("data", "expert"),)}),
}  # fmt: skip


def _build(name, *, meta):
    factory, axes, rules, loss, _, options = CONFIGS[name]
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = factory()
    plan = ts.plan(model, ts.make_mesh(axes), rules(model))
    kind = AbstractTrainer if meta else ts.Trainer
    return kind(model, loss, optax.adamw(1e-3), plan, **options)


def _bytes(trainer, batch):
    stats = trainer.lower(batch).compile().memory_analysis()
    return stats.argument_size_in_bytes, stats.temp_size_in_bytes, stats.output_size_in_bytes


def _specs(trainer):
    return jax.tree.map(lambda s: s.spec, trainer.state_shardings())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "gpipe" else n for n in CONFIGS])
def test_abstract_and_real_trainers_compile_the_same_state(name):
    real, abstract = _build(name, meta=False), _build(name, meta=True)
    batch = CONFIGS[name][4]()
    shapes = jax.tree.map(lambda t: jax.ShapeDtypeStruct(tuple(t.shape), t.numpy().dtype), batch)
    assert _specs(abstract) == _specs(real)
    assert _bytes(abstract, shapes) == _bytes(real, batch)
    assert abstract.idle_fraction == real.idle_fraction


def test_a_pipelined_stack_is_split_over_the_stage_axis_in_both():
    real, abstract = _build("gpipe", meta=False), _build("gpipe", meta=True)
    key = "blocks.*.up.weight"
    assert real.state.params[key].sharding.spec[0] == "stage"
    assert abstract.state.params[key].sharding.spec[0] == "stage"
