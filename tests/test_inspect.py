"""torchshard.inspect: HLO collective parsing, the collectives of DP / TP / FSDP steps, compiled memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch import nn
from torch.nn import functional as F

import torchshard as ts
from testsupport.models import MLP, tiny_llama
from torchshard import ShardingError, presets
from torchshard.inspect import (
    KINDS,
    AbstractTrainer,
    Collective,
    CollectiveStats,
    axes_of,
    collectives,
    matmuls,
    memory,
    parse_hlo,
)

BATCH = 16  # rows; 4 per device on data=4

SNIPPETS = {
    "list groups": (
        "%all-reduce.1 = f32[4,64]{1,0} all-reduce(f32[4,64]{1,0} %dot), channel_id=1, "
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add",
        "all-reduce",
        4 * 64 * 4,
        ((0, 1), (2, 3), (4, 5), (6, 7)),
    ),
    "combined tuple with index comment": (
        "%all-reduce.7 = (f32[64]{0}, f32[64,32]{1,0}, /*index=2*/bf16[]) all-reduce(%a, %b, /*index=2*/%c), "
        "channel_id=1, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, to_apply=%region_0",
        "all-reduce",
        64 * 4 + 64 * 32 * 4 + 2,
        ((0, 1, 2, 3, 4, 5, 6, 7),),
    ),
    "mesh groups with device ids": (
        "%ar = (f32[], f32[]) all-reduce(%a, %b), channel_id=10, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, to_apply=%r",
        "all-reduce",
        8,
        ((0, 1), (2, 3), (4, 5), (6, 7)),
    ),
    "iota groups": (
        "%all-gather = f32[16,32]{1,0} all-gather(f32[4,32]{1,0} %p), channel_id=1, "
        "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true",
        "all-gather",
        16 * 32 * 4,
        ((0, 2, 4, 6), (1, 3, 5, 7)),
    ),
    "empty groups are every partition": (
        "HloModule jit_f, num_partitions=4\n"
        "ROOT %reduce-scatter = s32[2]{0} reduce-scatter(s32[8]{0} %x), replica_groups={}, dimensions={0}",
        "reduce-scatter",
        8,
        ((0, 1, 2, 3),),
    ),
    "all-to-all": (
        "%all-to-all = f16[8,8]{1,0} all-to-all(f16[8,8]{1,0} %x), replica_groups={{0,1,2,3}}, dimensions={1}",
        "all-to-all",
        128,
        ((0, 1, 2, 3),),
    ),
    "collective-permute pairs": (
        "%collective-permute = f32[3]{0} collective-permute(f32[3]{0} %x), "
        "source_target_pairs={{0,1},{1,0},{2,3},{3,2}}",
        "collective-permute",
        12,
        ((0, 1), (1, 0), (2, 3), (3, 2)),
    ),
    "async start/done counted once": (
        "%all-gather-start = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %p), "
        "replica_groups={{0,1,2,3}}, dimensions={0}\n"
        "%all-gather-done = f32[16]{0} all-gather-done((f32[4]{0}, f32[16]{0}) %all-gather-start)",
        "all-gather",
        64,
        ((0, 1, 2, 3),),
    ),
    "unknown groups": (
        "%all-reduce = f32[2]{0} all-reduce(f32[2]{0} %x), to_apply=%add",
        "all-reduce",
        8,
        None,
    ),
}


@pytest.mark.parametrize(("text", "kind", "nbytes", "groups"), SNIPPETS.values(), ids=SNIPPETS.keys())
def test_parse_hlo_snippets(text, kind, nbytes, groups):
    (op,) = parse_hlo(text)
    assert (op.kind, op.bytes, op.groups) == (kind, nbytes, groups)


@pytest.mark.parametrize(
    "text",
    [
        "%fusion = f32[4]{0} fusion(f32[4]{0} %all-reduce.1), kind=kLoop, calls=%fused",  # operand named like one
        '%dot = f32[4]{0} dot(%a, %b), metadata={op_name="all-gather(x)"}',
        "%add = f32[] add(f32[] %x, f32[] %y)",
        "ENTRY %main (p: f32[4]) -> f32[4] {",
    ],
)
def test_parse_hlo_ignores_non_collectives(text):
    assert parse_hlo(text) == ()


MESH_AXES = {"data": 4, "model": 2}


@pytest.mark.parametrize(
    ("kind", "groups", "axes"),
    [
        ("all-reduce", ((0, 1), (2, 3), (4, 5), (6, 7)), ("model",)),
        ("all-reduce", ((0, 2, 4, 6), (1, 3, 5, 7)), ("data",)),
        ("all-gather", (tuple(range(8)),), ("data", "model")),
        ("all-reduce", ((0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)), ()),
        ("all-reduce", ((0, 3), (1, 2), (4, 7), (5, 6)), None),  # no axis makes these groups
        ("collective-permute", ((0, 2), (2, 4), (4, 6), (6, 0)), ("data",)),
        ("collective-permute", ((0, 1), (1, 0)), ("model",)),
    ],
)
def test_axes_of_names_mesh_axes(mesh_dm, kind, groups, axes):
    assert axes_of(Collective(kind, "op", (), 0, groups), mesh_dm) == axes


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def mlp_trainer(mesh_axes, rules):
    torch.manual_seed(0)
    model = MLP()
    plan = ts.plan(model, ts.make_mesh(mesh_axes), rules)
    return ts.Trainer(model, mse, optax.sgd(0.1), plan)


def mlp_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 16, generator=g)


def test_data_parallel_all_reduces_gradients_and_gathers_nothing():
    stats = collectives(mlp_trainer({"data": 8}, presets.data_parallel()), mlp_batch())
    assert stats.count("all-gather") == 0
    assert stats.count("all-reduce") == stats.count("all-reduce", axes="data") >= 1
    grad_bytes = sum(p.numel() * 4 for p in MLP().parameters())
    assert stats.nbytes("all-reduce") >= grad_bytes  # every gradient is summed over the batch shards


def test_cross_entropy_keeps_the_batch_sharded():
    # torchax's own aten.gather indexes with coordinate grids GSPMD cannot split: it gathered the batch.
    torch.manual_seed(0)
    model = MLP()
    plan = ts.plan(model, ts.make_mesh({"data": 8}), presets.data_parallel())
    trainer = ts.Trainer(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), optax.sgd(0.1), plan)
    labels = torch.randint(0, 16, (BATCH,), generator=torch.Generator().manual_seed(2))
    stats = collectives(trainer, (mlp_batch()[0], labels))
    assert stats.count("all-gather") == 0, stats
    assert stats.count() == stats.count("all-reduce", axes="data")


def test_tensor_parallel_all_reduces_the_row_parallel_output():
    rules = presets.tensor_parallel(colwise=[r"layers\.0"], rowwise=[r"layers\.1"])
    stats = collectives(mlp_trainer(MESH_AXES, rules), mlp_batch())
    # layers.1 is row-parallel: its [batch/data, 64] partial sums are reduced over "model"
    out = f"f32[{BATCH // MESH_AXES['data']},64]"
    over_model = [op for op in stats.ops if op.axes == ("model",) and op.kind in ("all-reduce", "reduce-scatter")]
    assert any(out in op.shapes for op in over_model), stats
    assert stats.count("all-reduce", axes="data") >= 1  # gradients
    assert stats.count("all-gather") == 0


def test_fsdp_gathers_weights_over_data():
    stats = collectives(mlp_trainer({"data": 8}, presets.fsdp(min_size=64)), mlp_batch())
    assert stats.count("all-gather", axes="data") >= 2
    assert stats.count() == stats.count(axes="data")


def test_jitted_function_and_its_arguments(mesh_dm):
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh_dm, P("data", "model")))
    stats = collectives(jax.jit(lambda a: a.sum(0)), x)
    assert stats.mesh is mesh_dm
    assert stats.count("all-reduce", axes="data") == 1
    assert stats.counts == {k: int(k == "all-reduce") for k in KINDS}


@pytest.mark.parametrize("stage", ["lowered", "compiled", "text"])
def test_stages_and_text_give_the_same_ops(mesh_dm, stage):
    x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh_dm, P("data", None)))
    lowered = jax.jit(lambda a: a.sum()).lower(x)
    target = {"lowered": lowered, "compiled": lowered.compile(), "text": lowered.compile().as_text()}[stage]
    assert collectives(target).ops == parse_hlo(lowered.compile().as_text())


def test_table_lists_kind_axes_count_and_bytes():
    stats = CollectiveStats(
        (
            Collective("all-reduce", "a", ("f32[4]",), 16, ((0, 1),), ("model",)),
            Collective("all-reduce", "b", ("f32[4]",), 16, ((0, 1),), ("model",)),
            Collective("all-gather", "c", ("f32[8]",), 32, None),
        )
    )
    lines = str(stats).splitlines()
    assert lines[0].split() == ["collective", "over", "count", "bytes/device", "runs/step", "bytes/step"]
    assert lines[2].split() == ["all-reduce", "model", "2", "32", "B", "2", "32", "B"]
    assert lines[3].split() == ["all-gather", "?", "1", "32", "B", "1", "32", "B"]
    assert lines[-1] == "3 collective(s), 64 B per device, 64 B per step"
    assert stats.bytes == {"all-reduce": 32, "all-gather": 32, "reduce-scatter": 0, "all-to-all": 0,
                           "collective-permute": 0}  # fmt: skip


HLO = "HloModule jit_step, entry_computation_layout={}"
MODULE = r"cannot read Linear \(a torch module: build a torchshard\.Trainer on it first\); pass a torchshard\.Trainer"
# an inspect function given what it cannot read (a torch module, HLO text where a Trainer is wanted, a number)
UNREADABLE = {
    "collectives-int": (lambda: collectives(42), r"collectives\(\) cannot read int; pass a torchshard\.Trainer"),
    "collectives-module": (lambda: collectives(nn.Linear(2, 2), torch.ones(8, 2)), rf"collectives\(\) {MODULE}"),
    "matmuls-module": (lambda: matmuls(nn.Linear(2, 2), torch.ones(8, 2)),
                       rf"matmuls\(\) {MODULE} \(or AbstractTrainer\) and a batch"),
    "matmuls-hlo": (lambda: matmuls(HLO, torch.ones(8, 2)),
                    r"matmuls\(\) cannot read str 'HloModule jit_step, entry_comp'; pass a torchshard\.Trainer"),
    "memory-module": (lambda: memory(nn.Linear(2, 2), torch.ones(8, 2)), rf"memory\(\) {MODULE}"),
    "memory-hlo": (lambda: memory(HLO), r"memory\(\) cannot read str 'HloModule jit_step, entry_comp'; pass a"),
}  # fmt: skip


@pytest.mark.parametrize(("call", "match"), UNREADABLE.values(), ids=UNREADABLE.keys())
def test_inspect_functions_reject_what_they_cannot_read(call, match):
    with pytest.raises(ts.ArgumentError, match=match):
        call()


def test_trainer_needs_exactly_one_batch():
    with pytest.raises(ShardingError, match=r"pass exactly one batch"):
        collectives(mlp_trainer({"data": 8}, presets.data_parallel()))


def test_unknown_kind_names_the_valid_ones():
    with pytest.raises(ShardingError, match=r"unknown collective kind 'allreduce'; use one of \['all-reduce'"):
        CollectiveStats(()).count("allreduce")


def test_memory_reads_the_compiled_step():
    trainer = mlp_trainer({"data": 8}, presets.fsdp(min_size=64))
    stats = trainer.lower(mlp_batch()).compile().memory_analysis()
    mem = memory(trainer, mlp_batch())
    assert (mem.argument_bytes, mem.temp_bytes, mem.output_bytes, mem.alias_bytes) == (
        stats.argument_size_in_bytes,
        stats.temp_size_in_bytes,
        stats.output_size_in_bytes,
        stats.alias_size_in_bytes,
    )
    assert mem.peak_bytes == mem.argument_bytes + mem.output_bytes - mem.alias_bytes + mem.temp_bytes
    assert mem.alias_bytes > 0  # params donated
    assert memory(trainer.lower(mlp_batch())) == mem
    assert "peak = arguments + outputs - aliased + temporaries" in str(mem)
    assert (mem.fits(mem.peak_bytes), mem.fits(mem.peak_bytes - 1), mem.margin(mem.peak_bytes + 5)) == (True, False, 5)


def test_abstract_trainer_compiles_the_same_step_without_the_model():
    with torch.device("meta"):
        meta = MLP()
    mesh = ts.make_mesh({"data": 8})
    abstract = AbstractTrainer(meta, mse, optax.sgd(0.1), ts.plan(meta, mesh, presets.fsdp(min_size=64)))
    shapes = (jax.ShapeDtypeStruct((BATCH, 32), np.float32), torch.empty(BATCH, 16, device="meta"))
    real = mlp_trainer({"data": 8}, presets.fsdp(min_size=64))
    assert abstract.lower(shapes).as_text() == real.lower(mlp_batch()).as_text()
    assert memory(abstract, shapes) == memory(real, mlp_batch())
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(abstract.state))


def test_abstract_trainer_errors():
    with torch.device("meta"):
        meta = MLP()
    plan = ts.plan(meta, ts.make_mesh({"data": 8}))
    abstract = AbstractTrainer(meta, mse, optax.sgd(0.1), plan)
    with pytest.raises(ShardingError, match=r"an AbstractTrainer holds shapes, not values"):
        abstract.step(mlp_batch())
    with pytest.raises(ShardingError, match=r"batch leaf #0 \(12, 32\) .*: dim 0 \(size 12\) is not divisible by data"):
        abstract.lower(jax.ShapeDtypeStruct((12, 32), np.float32))
    with torch.device("meta"):
        other = MLP(sizes=(32, 48, 16))
    with pytest.raises(ShardingError, match=r"(?s)plan does not fit MLP.*mis-shaped layers\.0\.weight"):
        AbstractTrainer(other, mse, optax.sgd(0.1), plan)
    with pytest.raises(ShardingError, match=r"memory\(trainer, batch\): pass the batch"):
        memory(abstract)
    with pytest.raises(ShardingError, match=r"memory\(\) cannot read int"):
        memory(42)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.slow
def test_a_scanned_fsdp_llama_keeps_its_activations_sharded_by_batch():
    # left free, GSPMD shards the scan's carry like the FSDP weights (hidden dim over "data") and
    # every device holds all 16 rows: f32[16,32,...] activations and ~5x the temp memory (a 2-layer
    # Llama-3-8B-shaped step on 256 devices: 21.9 GiB of temporaries instead of 2.1)
    model = tiny_llama(layers=2, meta=True)
    plan = ts.plan(model, ts.make_mesh({"data": 8, "model": 1}), presets.hf_rules(model))
    ids = jax.ShapeDtypeStruct((16, 32), np.int32)
    scanned = AbstractTrainer(model, lm_loss, optax.adamw(1e-3), plan, scan_layers=True).lower(ids).compile()
    whole_batch = [line for line in scanned.as_text().splitlines() if "= f32[16,32," in line]
    assert not whole_batch, whole_batch[:3]


def test_step_bytes_count_a_loop_body_as_often_as_it_runs(mesh_dm):
    # by hand: one all-reduce of the [8] f32 shard per iteration (32 B), 5 iterations, plus one after the loop
    add = jax.shard_map(lambda x: x + jax.lax.psum(x, "data"), mesh=mesh_dm, in_specs=P("data"), out_specs=P("data"))
    twice = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh_dm, in_specs=P("data"), out_specs=P())
    f = jax.jit(lambda x: twice(jax.lax.fori_loop(0, 5, lambda _, x: add(x), x)))
    x = jax.device_put(np.ones((32,), np.float32), NamedSharding(mesh_dm, P("data")))
    stats = collectives(f, x)
    assert stats.count("all-reduce", axes="data") == 2
    assert stats.nbytes("all-reduce", axes="data") == 2 * 32
    assert stats.runs is not None and sorted(stats.runs) == [1, 5]
    assert stats.step_bytes("all-reduce", axes="data") == 6 * 32
    assert stats.per_axes == {"data": 6 * 32}
    assert str(stats).splitlines()[-1].endswith("64 B per device, 192 B per step")


def test_step_costs_count_one_branch_of_a_conditional():
    from torchshard._hlo.costs import step_costs

    x = jax.ShapeDtypeStruct((16, 16), np.float32)
    heavy = lambda x: x @ x @ x  # noqa: E731  two matmuls: 2 × 2·16³ FLOPs
    light = lambda x: x @ x  # noqa: E731
    both = jax.jit(lambda p, x: jax.lax.cond(p, heavy, light, x)).lower(True, x).compile().as_text()
    assert step_costs(both).flops == 2 * 2 * 16**3
    three = jax.jit(lambda i, x: jax.lax.switch(i, [light, heavy, lambda x: x * 2], x)).lower(1, x).compile()
    assert step_costs(three.as_text()).flops == 2 * 2 * 16**3
