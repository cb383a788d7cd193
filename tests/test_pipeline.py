"""Pipeline parallelism: pipelined training against eager torch and the unpipelined run, checkpoints, HLO, errors."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard as ts
from testsupport.helpers import assert_trees_close, to_numpy, torch_losses
from testsupport.models import Block, BlockStack
from torchshard import ArgumentError, Pipeline, ShardingError, presets

LR, WD = 1e-3, 0.01
DEPTH, VOCAB = 8, 64
FSDP = presets.fsdp(min_size=256)
BLOCK_TP = presets.tensor_parallel(colwise=[r"blocks\.\d+\.up"], rowwise=[r"blocks\.\d+\.down"]) + FSDP
# name: (mesh, rules, Pipeline, other Trainer arguments)
RUNS = {
    "gpipe": ({"stage": 4, "data": 2}, FSDP, Pipeline(microbatches=4), {}),
    "circular": ({"stage": 2, "data": 2, "model": 2}, BLOCK_TP, Pipeline(microbatches=2, schedule="circular",
                 repeats=2), {"remat": r"blocks\.\d+", "grad_accum_steps": 2}),
}  # fmt: skip


def blocks_loss(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def batches(n=5, rows=8, vocab=VOCAB):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (rows, 12), generator=g) for _ in range(n)]


def blocks(depth=DEPTH):
    torch.manual_seed(0)
    return BlockStack(depth=depth)


def adamw():
    return optax.adamw(LR, weight_decay=WD)


def trainer(name, model=None, **overrides):
    axes, rules, pipeline, kwargs = RUNS[name]
    model = model or blocks()
    plan = ts.plan(model, ts.make_mesh(axes), rules)
    return ts.Trainer(model, blocks_loss, adamw(), plan, pipeline=pipeline, **(kwargs | overrides))


def values(module):
    return {k: to_numpy(v) for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def eager():
    """Eager torch after 4 AdamW steps, and its losses over all 5 batches."""
    model = blocks()
    losses = torch_losses(model, blocks_loss, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), batches())
    # the state after 4 steps: rerun 4 (the fifth changed the model)
    after4 = blocks()
    torch_losses(after4, blocks_loss, torch.optim.AdamW(after4.parameters(), lr=LR, weight_decay=WD), batches(4))
    return losses, values(after4)


@pytest.fixture(scope="module")
def unpipelined():
    model = blocks()
    run = ts.Trainer(model, blocks_loss, adamw(), ts.plan(model, ts.make_mesh({"data": 8}), FSDP))
    losses = [float(run.step(b)["loss"]) for b in batches(4)]
    return run, losses


@pytest.fixture(scope="module")
def built():
    """Each pipelined Trainer as built: what the quick tests of its schedule, plan and names read (no step
    compiled; `trained` steps these same Trainers, so where it ran first they have taken 4 steps)."""
    return {name: trainer(name) for name in RUNS}


@pytest.fixture(scope="module")
def trained(built):
    """Each pipelined run after 4 steps, with its losses."""
    return {name: (run, [float(run.step(b)["loss"]) for b in batches(4)]) for name, run in built.items()}


@pytest.mark.parametrize("name", list(RUNS))
@pytest.mark.slow
def test_trains_like_eager_torch_and_like_the_unpipelined_run(name, trained, eager, unpipelined):
    run, losses = trained[name]
    np.testing.assert_allclose(losses, eager[0][:4], rtol=1e-4)
    np.testing.assert_allclose(losses, unpipelined[1], rtol=1e-5)
    assert_trees_close(values(run.model), values(unpipelined[0].model), tol=1e-4)
    assert_trees_close(values(run.model), eager[1], tol=1e-4)


@pytest.mark.slow
def test_each_stage_holds_only_its_layers(trained):
    run, _ = trained["gpipe"]
    weight = run.state.params["blocks.*.up.weight"]
    assert weight.sharding.spec == P("stage", "data", None)  # the stage axis on the layer dim, FSDP behind it
    mesh = run.mesh
    for device, index in weight.sharding.devices_indices_map(weight.shape).items():
        stage = int(np.argwhere(mesh.devices == device)[0][0])
        assert index[0] == slice(2 * stage, 2 * stage + 2)  # 8 layers, 4 stages: two each
    opt_leaves = [x for x in jax.tree.leaves(run.state.opt_state) if x.shape == weight.shape]
    assert opt_leaves and all(x.sharding.spec == weight.sharding.spec for x in opt_leaves)


@pytest.mark.slow
def test_the_compiled_step_moves_activations_by_collective_permute_and_holds_a_quarter(trained, unpipelined):
    run, _ = trained["gpipe"]
    compiled = run.lower(batches(1)[0]).compile()
    assert "collective-permute" in compiled.as_text()
    dense = unpipelined[0].lower(batches(1)[0]).compile()
    assert "collective-permute" not in dense.as_text()
    layer_bytes = sum(x.addressable_shards[0].data.nbytes for k, x in run.state.params.items() if "*" in k)
    entries = [e for e in run.plan.entries.values() if e.name.startswith("blocks.")]
    assert layer_bytes == sum(e.bytes_per_device for e in entries if e.group == "stage 0")  # as the plan table says
    assert layer_bytes * 4 == sum(e.bytes_per_device for e in entries)  # a quarter of the layers the plan shards


def test_bubble_is_the_idle_fraction_of_the_schedule(built):
    assert built["gpipe"].idle_fraction == pytest.approx(3 / (4 + 3))
    assert built["circular"].idle_fraction == pytest.approx(1 / (2 * 2 + 1))
    model = blocks()
    assert ts.Trainer(model, blocks_loss, adamw(), ts.plan(model, ts.make_mesh({"data": 8}), FSDP)).idle_fraction == 0
    assert Pipeline(microbatches=8, schedule="circular", repeats=2).bubble(stages=4) == pytest.approx(3 / 19)


def test_plan_table_says_which_stage_holds_each_layer(built):
    run = built["circular"]  # 8 layers in 4 chunks of 2 on 2 stages: chunk j on stage j mod 2
    stages = {r["name"]: r["stage"] for r in run.plan.rows()}
    assert [stages[f"blocks.{i}.up.weight"] for i in range(DEPTH)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert stages["embed.weight"] is None and stages["head.weight"] is None
    table = run.plan.table()
    assert table.splitlines()[0].split()[:5] == ["name", "shape", "dtype", "spec", "stage"]
    assert any(line.startswith("blocks.2.up.weight") and " 1 " in line for line in table.splitlines())
    stored = run.layout.stacks()["blocks.*.up.weight"]
    assert stored == [f"blocks.{i}.up.weight" for i in (0, 1, 4, 5, 2, 3, 6, 7)]  # stage 0's chunks, then stage 1's
    json.dumps(run.plan.rows())


def test_names_are_torch_names(built, tmp_path):
    run = built["circular"]
    state = ts.to_torch_state_dict(run.model)
    assert list(state) == list(blocks().state_dict())
    np.testing.assert_array_equal(state["blocks.4.up.weight"].numpy(), to_numpy(run.model.blocks[4].up.weight))
    index = ts.save_safetensors(tmp_path / "hf", run)
    assert set(json.loads(index.read_text())["weight_map"]) == set(blocks().state_dict())


@pytest.mark.parametrize(
    ("source", "destination"),
    [("circular", "unpipelined"), ("unpipelined", "gpipe"), ("gpipe", "circular")],
)
@pytest.mark.slow
def test_checkpoints_load_pipelined_or_not_on_another_mesh(source, destination, trained, unpipelined, eager, tmp_path):
    saved = unpipelined[0] if source == "unpipelined" else trained[source][0]
    ts.save(tmp_path, saved)
    if destination == "unpipelined":
        model = blocks()
        target = ts.Trainer(model, blocks_loss, adamw(), ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), FSDP))
    else:
        target = trainer(destination)
    ts.load(tmp_path, target)
    assert target.step_count == 4
    assert_trees_close(values(target.model), values(saved.model), tol=0)
    loss = float(target.step(batches()[4])["loss"])  # resumes where eager torch's fifth step is
    np.testing.assert_allclose(loss, eager[0][4], rtol=1e-4)


class Gated(nn.Module):
    """A block called with a second per-row argument: the pipeline splits it into micro-batches with the rows."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, h, keep):
        return h + keep * (self.block(h) - h)


class GatedStack(BlockStack):
    def __init__(self):
        super().__init__(depth=4)
        self.blocks = nn.ModuleList(Gated() for _ in range(4))

    def forward(self, ids):
        h = self.embed(ids)
        keep = (ids % 3 != 0).unsqueeze(-1).float()  # [B, T, 1], different for every row
        for block in self.blocks:
            h = block(h, keep)
        return self.head(self.norm(h))


@pytest.mark.slow
def test_call_arguments_with_the_batch_rows_are_split_with_them():
    data = batches(3)
    torch.manual_seed(0)
    ref = GatedStack()
    expected = torch_losses(ref, blocks_loss, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD), data)
    torch.manual_seed(0)
    run = trainer("gpipe", GatedStack())
    np.testing.assert_allclose([float(run.step(b)["loss"]) for b in data], expected, rtol=1e-4)


class Rotary(nn.Module):
    """A torchtitan-style layer on a flat token stream: h [T, H] rotated by its positions (RoPE), then an MLP."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, h, positions):
        freqs = 100.0 ** -(torch.arange(16, device=h.device) / 16)
        angles = positions.reshape(-1, 1) * freqs  # [T, H/2], one row per token: [T] and [T, 1] alike
        first, second = h.chunk(2, -1)
        cos, sin = angles.cos(), angles.sin()
        return self.block(torch.cat([first * cos - second * sin, first * sin + second * cos], -1))


class FlatStream(BlockStack):
    """tokens [T] embedded to [T, H]; every layer takes (h, positions). ``column``: positions passed as [T, 1]."""

    def __init__(self, column=False):
        super().__init__(depth=4)
        self.blocks = nn.ModuleList(Rotary() for _ in range(4))
        self.column = column

    def forward(self, tokens, positions):
        h = self.embed(tokens)
        positions = positions[:, None] if self.column else positions
        for block in self.blocks:
            h = block(h, positions)
        return self.head(self.norm(h))


def stream_loss(model, batch):
    tokens, positions, targets = batch
    return nn.functional.cross_entropy(model(tokens, positions), targets)


def streams(n=3, tokens=32):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, VOCAB, (tokens,), generator=g), torch.arange(tokens) % 8,
             torch.randint(0, VOCAB, (tokens,), generator=g)) for _ in range(n)]  # fmt: skip


def stream_trainer(model):
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 4}), FSDP)
    return ts.Trainer(model, stream_loss, adamw(), plan, pipeline=Pipeline(microbatches=2))


def test_a_flat_stream_whose_positions_go_whole_to_every_micro_batch_names_the_split_and_the_fix():
    torch.manual_seed(0)
    run = stream_trainer(FlatStream())
    split = (r"Pipeline: blocks: a layer failed \(.+\) after the pipeline split the hidden state \[32, 32\] "
             r"along dim 0 into microbatches=2 of 16 rows and gave positions \(int32\[32\]\) whole to every "
             r"micro-batch: a rank-1 argument is taken as per-position.*")  # fmt: skip
    fixes = r"x\[:, None\], shape \[32, 1\]\) so it is split with them.*tokens \[B, S\] with positions \[B, S\]"
    with pytest.raises(ShardingError, match=split + fixes):
        run.step(streams(1)[0])


class Biased(nn.Module):
    """A block taking a per-head bias with the rows folded into its leading dim, [rows × heads, 1, dim / heads]:
    Bloom's ALiBi layout."""

    def __init__(self, heads=4):
        super().__init__()
        self.block, self.heads = Block(), heads

    def forward(self, h, bias):
        b, s, d = h.shape
        return self.block((h.reshape(b * self.heads, s, d // self.heads) + bias).reshape(b, s, d))


class FoldedBias(BlockStack):
    def __init__(self):
        super().__init__(depth=4)
        self.blocks = nn.ModuleList(Biased() for _ in range(4))

    def forward(self, ids):
        h = self.embed(ids)
        bias = torch.arange(4 * ids.shape[0], dtype=h.dtype, device=h.device)[:, None, None].repeat(1, 1, 8) / 10
        for block in self.blocks:
            h = block(h, bias)
        return self.head(self.norm(h))


def test_an_argument_that_folds_the_rows_with_another_dim_is_named_with_the_fix():
    torch.manual_seed(0)
    model = FoldedBias()
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 4}), FSDP)
    trainer = ts.Trainer(model, blocks_loss, adamw(), plan, pipeline=Pipeline(microbatches=2))
    folded = (
        r"Pipeline: blocks: a layer failed \(.+\) after the pipeline split the hidden state \[8, 11, 32\] "
        r"along dim 0 into microbatches=2 of 4 rows and gave bias \(float32\[32, 1, 8\], 8 rows × 4\) whole to "
        r"every micro-batch: its leading dim folds the rows with another dim.*rows leading"
    )
    with pytest.raises(ShardingError, match=folded):
        trainer.step(batches(1)[0])
    assert trainer.step_count == 0


@pytest.mark.slow
def test_a_flat_stream_with_per_row_positions_marked_as_a_column_trains_like_eager_torch():
    data = streams()
    torch.manual_seed(0)
    ref = FlatStream(column=True)
    expected = torch_losses(ref, stream_loss, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD), data)
    torch.manual_seed(0)
    run = stream_trainer(FlatStream(column=True))
    np.testing.assert_allclose([float(run.step(b)["loss"]) for b in data], expected, rtol=1e-4)


class Rotated(nn.Module):
    """A block whose input is first rotated as complex numbers, as DeepSeek-V2's rotary embedding (freqs_cis)."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, h, freqs):
        rotated = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2)) * freqs
        return self.block(torch.view_as_real(rotated).flatten(-2))


class ComplexRotary(BlockStack):
    def __init__(self):
        super().__init__(depth=4)
        self.blocks = nn.ModuleList(Rotated() for _ in range(4))

    def forward(self, ids):
        h = self.embed(ids)
        angles = torch.arange(ids.shape[1], device=h.device)[:, None] * 100.0 ** -(torch.arange(16) / 16)
        freqs = torch.polar(torch.ones_like(angles), angles)  # [seq, dim / 2] complex64
        for block in self.blocks:
            h = block(h, freqs)
        return self.head(self.norm(h))


@pytest.mark.parametrize(
    "kwargs",
    [{}, pytest.param({"remat": ts.Remat(r"blocks\.\d+", policy="everything_saveable")}, marks=pytest.mark.slow)],
    ids=["all", "remat"],
)
def test_layers_that_multiply_complex_numbers_train_like_eager_torch_under_gpipe(kwargs):
    # gpipe's backward keeps what each layer computes, which remat rounds with reduce_precision: no complex dtype
    data = batches(3)
    torch.manual_seed(0)
    ref = ComplexRotary()
    expected = torch_losses(ref, blocks_loss, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD), data)
    torch.manual_seed(0)
    model = ComplexRotary()
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 4}), FSDP)
    run = ts.Trainer(model, blocks_loss, adamw(), plan, pipeline=Pipeline(microbatches=2), **kwargs)
    np.testing.assert_allclose([float(run.step(b)["loss"]) for b in data], expected, rtol=1e-4)


def hf_loss(model, batch):
    ids, mask = batch
    return model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss


HF = {  # family: (mesh, tensor-parallel axis, micro-batches)
    "llama": ({"stage": 2, "data": 2, "model": 2}, "model", 4),
    "gpt2": ({"stage": 2, "data": 4}, None, 2),  # GPT-2 has no tensor-parallel plan
    "mixtral": ({"stage": 4, "model": 2}, "model", 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(HF))
def test_hf_models_train_like_eager_torch(family):
    from tools.families import Family, build

    axes, tp, microbatches = HF[family]
    model_family = Family(family, moe=family == "mixtral", extra=(("num_hidden_layers", 4),))
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[::3, -4:] = 0  # padding: a 4-D mask per row, split into micro-batches with the hidden state
    data = [(torch.randint(0, 128, (8, 12), generator=g), mask) for _ in range(4)]
    ref = build(model_family)
    expected = torch_losses(ref, hf_loss, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD), data)
    model = build(model_family)
    fsdp = "data" if "data" in axes else None
    plan = ts.plan(model, ts.make_mesh(axes), presets.hf_rules(model, axis=tp, fsdp_axis=fsdp, fsdp_min_size=1024))
    batch_spec = (fsdp,) if fsdp else ()
    run = ts.Trainer(model, hf_loss, adamw(), plan, pipeline=Pipeline(microbatches=microbatches), batch_spec=batch_spec)
    np.testing.assert_allclose([float(run.step(b)["loss"]) for b in data], expected, rtol=1e-4)
    assert list(ts.to_torch_state_dict(run.model)) == list(ref.state_dict())


# ---- shapes a pipeline cannot take: each a ShardingError naming the sizes that work ----


class NoStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList([Block(), Block(32, 32)])  # different shapes
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class TwoStacks(BlockStack):
    def __init__(self):
        super().__init__(depth=2)
        self.more = nn.ModuleList(Block() for _ in range(2))


class NormStack(BlockStack):
    def __init__(self):
        super().__init__(depth=2)
        for block in self.blocks:
            block.norm = nn.BatchNorm1d(11)  # running stats: a buffer each step updates


def build_error(model, axes, pipeline, rules=FSDP, **kwargs):
    ts.Trainer(model, blocks_loss, adamw(), ts.plan(model, ts.make_mesh(axes), rules), pipeline=pipeline, **kwargs)


@pytest.mark.parametrize(
    ("make", "axes", "pipeline", "kwargs", "match"),
    [
        (lambda: blocks(6), {"stage": 4, "data": 2}, Pipeline(), {},
         r"blocks has 6 layers, not divisible into stage \(4\) × repeats \(1\) = 4 chunks.*one of \[1, 2, 3, 6\]"),
        (lambda: blocks(8), {"stage": 2, "data": 4}, Pipeline(microbatches=4, schedule="circular", repeats=3), {},
         r"8 layers, not divisible into stage \(2\) × repeats \(3\) = 6"),
        (blocks, {"stage": 4, "data": 2}, Pipeline(microbatches=2), {},
         r"microbatches=2 is fewer than the 4 stages: use microbatches ≥ 4"),
        (blocks, {"data": 8}, Pipeline(), {}, r"Mesh\(data=8\) has no axis 'stage'"),
        (NoStack, {"stage": 2, "data": 4}, Pipeline(), {},
         r"no stack of identical layers in NoStack.*blocks.1 differs from block 0"),
        (TwoStacks, {"stage": 2, "data": 4}, Pipeline(), {}, r"several stacks.*\['blocks', 'more'\].*layers="),
        (TwoStacks, {"stage": 2, "data": 4}, Pipeline(layers="block"), {}, r"matches no ModuleList.*'blocks', 'more'"),
        (blocks, {"stage": 2, "data": 4}, Pipeline(), {"batch_spec": (("data", "stage"),)},
         r"batch_spec .* shards the batch over the stage axis 'stage'"),
    ],
)  # fmt: skip
def test_shapes_it_cannot_take(make, axes, pipeline, kwargs, match):
    with pytest.raises(ShardingError, match=match):
        build_error(make(), axes, pipeline, **kwargs)


def test_a_plan_sharding_layers_over_the_stage_axis_is_refused():
    rules = ts.Rules([(r"blocks\.\d+\.up\.weight", ("stage", None))])
    with pytest.raises(ShardingError, match=r"blocks.0.up.weight spec P\('stage', None\).*over the other axes"):
        build_error(blocks(), {"stage": 2, "data": 4}, Pipeline(), rules=rules)


def test_a_batch_the_microbatches_do_not_divide_is_refused(built):
    run = built["gpipe"]  # data=2, 4 micro-batches: batches of 8, 16, ... rows
    with pytest.raises(ShardingError, match=r"dim 0 \(size 12\) is not divisible by data \(size 2\) × microbatches "
                       r"4; use a batch size that is a multiple of 8"):  # fmt: skip
        run.step(batches(1, rows=12)[0])


class FewRows(BlockStack):
    def forward(self, ids):
        h = self.embed(ids[:3])  # the stack sees 3 of the batch's rows
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_hidden_state_the_microbatches_do_not_divide_is_refused():
    torch.manual_seed(0)
    model = FewRows(depth=2)
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 4}))
    run = ts.Trainer(model, lambda m, ids: m(ids).mean(), adamw(), plan, pipeline=Pipeline())
    with pytest.raises(ShardingError, match=r"hidden state \[3, 12, 32\] does not split into microbatches=2.*e\.g\. 4"):
        run.step(batches(1)[0])


@pytest.mark.slow
def test_dropout_inside_pipelined_blocks_draws_masks():
    torch.manual_seed(0)
    model = BlockStack(depth=4, dropout=0.5)
    plain = blocks_loss(model.eval(), batches(1)[0]).item()
    run = ts.Trainer(model.train(), blocks_loss, adamw(), ts.plan(model, ts.make_mesh({"stage": 2, "data": 4})),
                     pipeline=Pipeline())  # fmt: skip
    loss = float(run.step(batches(1)[0])["loss"])
    assert np.isfinite(loss) and abs(loss - plain) > 1e-3


def test_a_block_updating_buffers_is_refused():
    with pytest.raises(ShardingError, match=r"blocks.0 updates its buffer\(s\) \['norm.num_batches_tracked'"):
        model = NormStack()
        ts.Trainer(model, blocks_loss, adamw(), ts.plan(model, ts.make_mesh({"stage": 2, "data": 4})),
                   pipeline=Pipeline()).step(batches(1)[0])  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"schedule": "zero-bubble"},
            r"schedule='zero-bubble' must be one of \['gpipe', 'circular', '1f1b', '1f1b_remat', 'zero_bubble'\]",
        ),
        ({"repeats": 2}, r"repeats=2 needs schedule='circular'"),
        ({"microbatches": 0}, r"microbatches=0 must be an int ≥ 1"),
        ({"axis": 3}, r"axis=3 must be a mesh axis name"),
        ({"layers": "blocks.("}, r"layers='blocks.\(' is not a valid regex .*name the ModuleList"),
        ({"layers": 3}, r"layers=3 .*name the ModuleList"),
    ],
)
def test_bad_pipeline_arguments(kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        Pipeline(**kwargs)


def test_pipeline_must_be_a_pipeline():
    with pytest.raises(ArgumentError, match=r"pipeline must be None or a torchshard.Pipeline, got dict"):
        build_error(blocks(), {"stage": 2, "data": 4}, {"microbatches": 2})
