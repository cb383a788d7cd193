"""Stage-local construction: a pipelined Trainer built from a CPU model places each layer on its stage alone."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
import torch
from test_pipeline import FSDP, batches, blocks, blocks_loss, values

import torchshard as ts
from testsupport.helpers import assert_trees_close
from testsupport.models import Block
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


# --- built by init_sharded, restored by ts.load or load_safetensors: still stage-local -----------------------

MESH_AXES = {"stage": 4, "data": 2}
LAYER = re.compile(r"blocks\.(\d+)\.")


def _stage_rows(mesh, device):
    stage = int(np.argwhere(mesh.devices == device)[0][0])
    return set(range(2 * stage, 2 * stage + 2))  # 8 layers on 4 stages


def _layers_each_device_holds(name, array):
    """device → the layer indices ``array`` (named ``name``: one layer, or a stack of all 8) holds there."""
    found = LAYER.search(name)
    held = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        if found:
            held[device] = {int(found.group(1))}
        elif "blocks.*" in name and array.shape[0] == 8:
            held[device] = set(range(8)[index[0]])
    return held


def _assert_stage_local(named_arrays, mesh):
    checked = 0
    for name, array in named_arrays:
        for device, layers in _layers_each_device_holds(name, array).items():
            assert layers <= _stage_rows(mesh, device), (name, device, layers)
            checked += 1
    assert checked


@pytest.mark.slow
def test_init_sharded_with_a_pipeline_builds_each_stage_on_its_devices_with_the_same_values(monkeypatch):
    mesh = ts.make_mesh(MESH_AXES)
    calls = []
    original = ts._sharding.init._materialise

    def materialise(model_fn, p, seed, select, shardings):
        calls.append(shardings)
        return original(model_fn, p, seed, select, shardings)

    monkeypatch.setattr(ts._sharding.init, "_materialise", materialise)
    staged = ts.init_sharded(blocks, mesh, FSDP, seed=3, pipeline=Pipeline(microbatches=4))
    stage_devices = [set(mesh.devices[s].flat) for s in range(4)]
    whole, *per_stage = calls  # the tensors outside the stack on the whole mesh, then one call per stage
    assert len(whole) == len([n for n in values(staged) if not n.startswith("blocks.")])
    assert [{d for s in c for d in s.device_set} for c in per_stage] == stage_devices
    monkeypatch.undo()
    unstaged = ts.init_sharded(blocks, mesh, FSDP, seed=3)
    assert_trees_close(values(staged), values(unstaged), tol=0)  # the same build, stage by stage
    eager = values(blocks())
    for name in ("blocks.5.norm.weight", "blocks.5.norm.bias", "norm.weight"):  # deterministic inits: torch's
        np.testing.assert_array_equal(values(staged)[name], eager[name])
    stacked = staged.blocks[0].up.weight._stack.array
    _assert_stage_local([("blocks.*.up.weight", stacked)], mesh)
    run = ts.Trainer(
        staged, blocks_loss, optax.sgd(0.1), ts.plan(staged, mesh, FSDP), pipeline=Pipeline(microbatches=4)
    )
    held = run.state.params["blocks.*.up.weight"]
    pointers = {s.device: s.data.unsafe_buffer_pointer() for s in held.addressable_shards}
    assert pointers == {s.device: s.data.unsafe_buffer_pointer() for s in stacked.addressable_shards}  # taken as is
    first = float(run.step(batches(1)[0])["loss"])
    placed = unstaged  # the same values, placed on every stage (built once: its values are checked above)
    other = ts.Trainer(
        placed, blocks_loss, optax.sgd(0.1), ts.plan(placed, mesh, FSDP), pipeline=Pipeline(microbatches=4)
    )
    assert first == float(other.step(batches(1)[0])["loss"])
    assert_trees_close(values(run.model), values(other.model), tol=0)


def test_init_sharded_names_a_pipeline_that_does_not_fit():
    mesh = ts.make_mesh({"stage": 8})
    with pytest.raises(ts.ArgumentError, match=r"pipeline.*Pipeline"):
        ts.init_sharded(blocks, mesh, FSDP, pipeline="gpipe")
    with pytest.raises(ts.ShardingError, match=r"blocks has 8 layers.*stage.*\(8\) × repeats \(2\)"):
        ts.init_sharded(blocks, mesh, pipeline=Pipeline(repeats=2, schedule="circular"))


def _flat(tree):
    return [(jax.tree_util.keystr(path), x) for path, x in jax.tree_util.tree_leaves_with_path(tree)]


def _pipelined(optimizer):
    model = blocks()
    mesh = ts.make_mesh(MESH_AXES)
    return ts.Trainer(model, blocks_loss, optimizer, ts.plan(model, mesh, FSDP), pipeline=Pipeline(microbatches=4))


@pytest.mark.parametrize("source", ["pipelined", "unpipelined"])
@pytest.mark.slow
def test_load_reads_each_layer_onto_its_stage_alone(source, monkeypatch, tmp_path):
    model = blocks()
    if source == "pipelined":
        saved = _pipelined(optax.sgd(0.1, momentum=0.9))
    else:  # every tensor saved per layer, sharded over data=8
        saved = ts.Trainer(
            model, blocks_loss, optax.sgd(0.1, momentum=0.9), ts.plan(model, ts.make_mesh({"data": 8}), FSDP)
        )
    saved.step(batches(1)[0])
    ts.save(tmp_path, saved)
    read = []
    original = ts._ckpt.load.read_state

    def read_state(directory, item, **kwargs):
        read.append(item)
        return original(directory, item, **kwargs)

    monkeypatch.setattr(ts._ckpt.load, "read_state", read_state)
    target = _pipelined(optax.sgd(0.1, momentum=0.9))
    ts.load(tmp_path, target)
    _assert_stage_local(_flat(read[0]), target.mesh)  # params and their momentum, as read
    blocks_read = [name for name, _ in _flat(read[0]) if "blocks" in name]
    assert len(blocks_read) == 2 * len(target.layout.stacks()) * (8 if source == "unpipelined" else 1)
    _assert_stage_local(_flat(target.state), target.mesh)
    assert_trees_close(values(target.model), values(saved.model), tol=0)


@pytest.mark.slow
def test_load_safetensors_reads_each_stage_s_layers_onto_its_devices_alone(monkeypatch, tmp_path):
    saved = blocks()
    ts.save_safetensors(tmp_path, ts.shard(saved, ts.plan(saved, ts.make_mesh({"data": 8}), FSDP)))
    target = _pipelined(optax.sgd(0.1))
    received = []
    original_callback = jax.make_array_from_callback

    def from_callback(shape, sharding, callback, *args, **kwargs):
        received.extend((shape, device, index) for device, index in sharding.devices_indices_map(shape).items())
        return original_callback(shape, sharding, callback, *args, **kwargs)

    monkeypatch.setattr(jax, "make_array_from_callback", from_callback)
    ts.load_safetensors(tmp_path, target)
    stacked = [(device, index) for shape, device, index in received if shape[0] == 8]
    assert len(stacked) == 8 * len(target.layout.stacks())
    for device, index in stacked:
        assert set(range(8)[index[0]]) == _stage_rows(target.mesh, device)
    assert_trees_close(values(target.model), values(saved), tol=0)


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(128, 512) for _ in range(8))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _mse(model, batch):
    return (model(batch[0]) - batch[1]).square().mean()


@pytest.mark.slow
def test_the_step_keeps_one_gradient_of_the_stages_weights():
    """Weights dominate (SGD, a tiny batch): the step's temp is the stage's gradient, one layer's slice and its
    gradient, and little else. Before the loop stepped one layer at a time it also held a transposed copy of the
    stage's weights, a copy of every layer's slice and a second gradient (4.6x the weights; now 2.6x)."""
    model, mesh = _Blocks(), ts.make_mesh({"stage": 4, "data": 2})
    run = ts.Trainer(model, _mse, optax.sgd(0.1), ts.plan(model, mesh, ts.presets.data_parallel()),
                     pipeline=Pipeline(microbatches=4))  # fmt: skip
    memory = run.lower((torch.randn(8, 4, 128), torch.randn(8, 4, 128))).compile().memory_analysis()
    assert memory.temp_size_in_bytes <= 3 * memory.output_size_in_bytes  # outputs: the stage's updated weights


@pytest.mark.slow
def test_a_layer_views_shape_and_dtype_do_not_slice_its_stack(monkeypatch):
    model = ts.init_sharded(blocks, ts.make_mesh({"stage": 4, "data": 2}), FSDP, pipeline=Pipeline(microbatches=4))
    view = model.blocks[5].up.weight
    sliced = []
    monkeypatch.setattr(type(view._stack), "layer", lambda self, i: sliced.append(i))
    assert (tuple(view.shape), view.ndim, view.dim(), view.dtype) == ((64, 32), 2, 2, torch.float32)
    assert sliced == []
