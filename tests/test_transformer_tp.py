"""The annotated TP + FSDP transformer of examples/transformer_tp.py: its plan, parity with eager torch, collectives."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P

import torchshard as ts
from torchshard import presets

DIM, HEADS, LAYERS, BATCH, SEQ = 64, 4, 2, 8, 8


def load_example(name: str):
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tt = load_example("transformer_tp")


def transformer():
    torch.manual_seed(0)
    return tt.Transformer(DIM, HEADS, LAYERS)


def data(n):
    return tt.batches(n, batch=BATCH, seq=SEQ, dim=DIM)


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("layers.0.attention.q.weight", P("model", "data")),
        ("layers.0.attention.k.weight", P("model", "data")),
        ("layers.1.attention.v.weight", P("model", "data")),
        ("layers.1.attention.o.weight", P("data", "model")),
        ("layers.0.mlp.up.weight", P("model", "data")),
        ("layers.1.mlp.down.weight", P("data", "model")),
    ],
)
def test_annotations_compose_with_fsdp(mesh_dm, name, spec):
    plan = ts.plan(transformer(), mesh_dm, presets.fsdp("data", min_size=0))
    assert plan.spec(name) == spec


def test_same_modules_run_in_eager_torch():
    x, _ = data(1)[0]
    out = transformer()(x)  # constrain() leaves CPU tensors alone
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.shape == x.shape


@pytest.mark.parametrize("mesh_axes", tt.MESHES, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_adamw_losses_match_eager_torch(mesh_axes):
    model, batches = transformer(), data(3)
    expected = tt.eager_losses(copy.deepcopy(model), batches, lr=1e-2)
    got = tt.sharded_losses(model, batches, lr=1e-2, mesh_axes=mesh_axes)
    np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_heads_stay_sharded_and_row_parallel_outputs_are_reduced(mesh_dm):
    model = transformer()
    plan = ts.plan(model, mesh_dm, presets.fsdp("data", min_size=0))
    trainer = ts.Trainer(model, tt.mse, optax.sgd(0.1), plan)
    stats = ts.inspect.collectives(trainer, data(1)[0])
    assert stats.count("all-gather", axes="model") == 0, stats  # no activation is gathered over heads
    assert stats.count("all-gather") == stats.count("all-gather", axes="data") > 0  # FSDP weight gathers
    # o and down outputs of one data shard's tokens (flattened by the linear lowering): partial sums over model
    out = f"f32[{BATCH // 4 * SEQ},{DIM}]"
    reduced = [s for op in stats.ops if op.kind == "all-reduce" and op.axes == ("model",) for s in op.shapes]
    assert reduced.count(out) >= 2 * LAYERS, stats


def test_report_flags_a_mismatch(capsys):
    assert tt.report([("m", [1.0, 2.0], [1.0, 2.0])], rtol=1e-4)
    assert not tt.report([("m", [1.0, 2.0], [1.0, 2.1])], rtol=1e-4)
    assert "MISMATCH" in capsys.readouterr().out


def test_attention_needs_whole_heads():
    with pytest.raises(ValueError, match="dim 60 is not divisible by heads 8"):
        tt.Attention(60, 8)
