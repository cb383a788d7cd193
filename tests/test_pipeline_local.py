"""Stage-local construction: a pipelined Trainer built from a CPU model places each layer on its stage alone."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from test_pipeline import FSDP, batches, blocks, blocks_loss, values

import torchshard as ts
from torchshard import Pipeline


def test_each_device_receives_only_its_stages_layers(monkeypatch):
    placed, received = [], []
    original_put = ts._sharding.placement.put
    original_callback = jax.make_array_from_callback

    def put(value, sharding, **kwargs):
        placed.append(kwargs.get("what"))
        return original_put(value, sharding, **kwargs)

    def from_callback(shape, sharding, callback, *args, **kwargs):
        for device, index in sharding.devices_indices_map(shape).items():
            received.append((shape, device, index))
        return original_callback(shape, sharding, callback, *args, **kwargs)

    monkeypatch.setattr(ts._sharding.placement, "put", put)
    monkeypatch.setattr(jax, "make_array_from_callback", from_callback)
    model = blocks()
    mesh = ts.make_mesh({"stage": 4, "data": 2})
    run = ts.Trainer(model, blocks_loss, optax.sgd(0.1), ts.plan(model, mesh, FSDP), pipeline=Pipeline(microbatches=4))
    assert placed and not [name for name in placed if name.startswith("blocks.")]  # no layer placed one by one
    stacked = [(device, index) for shape, device, index in received if shape[0] == 8]  # [8 layers, ...] stacks
    assert len(stacked) == 8 * len(run.layout.stacks())
    for device, index in stacked:
        stage = int(np.argwhere(mesh.devices == device)[0][0])
        assert index[0] == slice(2 * stage, 2 * stage + 2)  # 8 layers on 4 stages: its two, no others


@pytest.mark.slow
def test_trains_as_one_built_from_a_sharded_model():
    batch = batches(1)[0]
    mesh = ts.make_mesh({"stage": 4, "data": 2})
    runs = []
    for placed in (False, True):  # stacked from the host, or from a module shard() placed first
        model = blocks()
        plan = ts.plan(model, mesh, FSDP)
        model = ts.shard(model, plan) if placed else model
        run = ts.Trainer(model, blocks_loss, optax.sgd(0.1), plan, pipeline=Pipeline(microbatches=4),
                         precision=ts.MixedPrecision())  # fmt: skip
        runs.append((float(run.step(batch)["loss"]), values(run.model)))
    assert runs[0][0] == runs[1][0]
    assert_trees_close(runs[0][1], runs[1][1], tol=0)
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(run.state.params))  # fp32 master weights
