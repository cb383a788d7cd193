"""scan_layers: a ModuleList of identical blocks as one lax.scan, against the same model unscanned and eager torch."""

from __future__ import annotations

import copy

import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard as ts
from testsupport.helpers import assert_close, assert_trees_close, to_numpy, torch_losses
from testsupport.models import Block, BlockStack, DictStack, tiny_llama
from torchshard import ShardingError, presets

# AdamW set explicitly on both sides (optax's default weight decay differs from torch's)
LR, WD = 1e-3, 0.01
MESHES = {"fsdp": {"data": 8}, "fsdp_tp": {"data": 4, "model": 2}}
BLOCK_TP = presets.tensor_parallel(colwise=[r"blocks\.\d+\.up"], rowwise=[r"blocks\.\d+\.down"])


def blocks_loss(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def llama_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


MODELS = {  # name: (factory, loss, rules per mesh, vocab)
    "blocks": (lambda: BlockStack(depth=4), blocks_loss, {"fsdp": presets.fsdp(min_size=256), "fsdp_tp": BLOCK_TP
               + presets.fsdp(min_size=256)}, 64),
    "llama": (lambda: tiny_llama(layers=3), llama_loss, {"fsdp": presets.fsdp(min_size=1024), "fsdp_tp": None}, 128),
}  # fmt: skip


def batches(vocab, n=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (8, 12), generator=g) for _ in range(n)]


def build(model_name, mesh_name, **kwargs):
    factory, loss, rules, _ = MODELS[model_name]
    torch.manual_seed(0)
    model = factory()
    rules = rules[mesh_name] if rules[mesh_name] is not None else presets.hf_rules(model, fsdp_min_size=1024)
    plan = ts.plan(model, ts.make_mesh(MESHES[mesh_name]), rules)
    return ts.Trainer(model, loss, optax.adamw(LR, weight_decay=WD), plan, **kwargs)


def state_of(module):
    return {k: to_numpy(v) for k, v in module.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize(("model_name", "mesh_name"), [("blocks", "fsdp"), ("blocks", "fsdp_tp"), ("llama", "fsdp_tp")])
def test_scanned_trains_like_unscanned_and_like_torch(model_name, mesh_name):
    factory, loss, _, vocab = MODELS[model_name]
    data = batches(vocab)
    torch.manual_seed(0)
    ref = factory()
    expected = torch_losses(ref, loss, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD), data)
    plain, scanned = build(model_name, mesh_name), build(model_name, mesh_name, scan_layers=True)
    got = {t: np.array([float(t.step(b)["loss"]) for b in data]) for t in (plain, scanned)}
    np.testing.assert_allclose(got[scanned], got[plain], rtol=1e-5)
    np.testing.assert_allclose(got[scanned], expected, rtol=1e-4)
    assert list(scanned.model.state_dict()) == list(ref.state_dict())
    assert_trees_close(state_of(scanned.model), state_of(plain.model), tol=1e-5)
    assert_trees_close(state_of(scanned.model), state_of(ref), tol=1e-4)


@pytest.mark.slow
def test_scanned_state_is_stacked_and_the_model_reads_it():
    trainer = build("blocks", "fsdp_tp", scan_layers="blocks")
    params = trainer.state.params
    assert "blocks.*.up.weight" in params and "blocks.2.up.weight" not in params
    assert params["blocks.*.up.weight"].shape == (4, 64, 32)
    assert params["blocks.*.up.weight"].sharding.spec == P(None, "model", "data")  # the plan's P("model", "data")
    trainer.step(batches(64, n=1)[0])
    weight = trainer.model.blocks[2].up.weight
    assert isinstance(weight, nn.Parameter) and weight.requires_grad
    np.testing.assert_array_equal(to_numpy(weight), to_numpy(trainer.state.params["blocks.*.up.weight"][2]))
    with pytest.raises(RuntimeError, match="one layer of a scanned Trainer's stacked weights"):
        weight._elem = weight.jax()


@pytest.mark.slow
def test_dropout_draws_the_same_masks_scanned_or_not():
    data = batches(64, n=3)
    trainers = []
    for scan in (False, True):
        torch.manual_seed(0)
        model = BlockStack(depth=3, dropout=0.3)
        plan = ts.plan(model, ts.make_mesh(MESHES["fsdp"]), presets.fsdp(min_size=256))
        trainers.append(ts.Trainer(model, blocks_loss, optax.sgd(0.1), plan, scan_layers=scan, seed=7))
    losses = [[float(t.step(b)["loss"]) for b in data] for t in trainers]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    assert_trees_close(state_of(trainers[1].model), state_of(trainers[0].model), tol=1e-6)


class Uneven(nn.Module):
    def __init__(self, blocks, shared=None):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(blocks)
        self.head = shared or nn.Linear(32, 64)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _shared():
    shared = Block()
    return Uneven([shared, shared])


@pytest.mark.parametrize(
    ("factory", "scan_layers", "error", "match"),
    [
        (lambda: BlockStack(), "embed", ShardingError, r"embed is a Embedding, not a torch\.nn\.ModuleList"),
        (lambda: BlockStack(), "nope", ShardingError, r"BlockStack has no module named 'nope'"),
        (lambda: BlockStack(), 3, TypeError, r"scan_layers=3 must be True, False, a ModuleList / ModuleDict name"),
        (lambda: Uneven([Block(), Block(hidden=128)]), "blocks", ShardingError,
         r"blocks\.1 differs from block 0: its parameters or buffers differ"),
        (lambda: Uneven([Block(), Block(dropout=0.1)]), "blocks", ShardingError,
         r"blocks\.1 differs from block 0: its setting dropout is 0\.1, block 0's is 0\.0"),
        (lambda: Uneven([Block(), nn.Linear(32, 32)]), "blocks", ShardingError,
         r"blocks\.1 is a Linear, block 0 a Block"),
        (lambda: Uneven([Block()]), "blocks", ShardingError, r"blocks has 1 block\(s\); a scan needs at least 2"),
        (_shared, "blocks", ShardingError, r"blocks\.0\.norm\.weight = blocks\.1\.norm\.weight.* one tensor shared"),
        (lambda: nn.Sequential(nn.Linear(4, 4)), True, ShardingError,
         r"scan_layers=True found no ModuleList or ModuleDict of identical blocks in Sequential"),
    ],
    ids=["not-a-list", "unknown", "bad-type", "shapes", "settings", "types", "one-block", "tied", "none-found"],
)  # fmt: skip
def test_lists_that_cannot_scan_say_why(mesh_fsdp, factory, scan_layers, error, match):
    model = factory()
    plan = ts.plan(model, mesh_fsdp)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        ts.Trainer(model, blocks_loss, optax.sgd(0.1), plan, scan_layers=scan_layers)
    assert all(type(v) is torch.Tensor and torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_scan_true_skips_an_unscannable_list_with_a_warning(mesh_fsdp):
    model = BlockStack(depth=2)
    model.extra = nn.ModuleList([nn.Linear(32, 32), nn.ReLU()])
    with pytest.warns(ts.ScanLayersWarning, match=r"leaves extra unscanned: extra\.1 is a ReLU"):
        trainer = ts.Trainer(model, blocks_loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp), scan_layers=True)
    assert "blocks.*.up.weight" in trainer.state.params and "extra.0.weight" in trainer.state.params


def test_layers_sharded_differently_cannot_stack(mesh_fsdp):
    model = BlockStack(depth=2)
    plan = ts.plan(model, mesh_fsdp, [(r"blocks\.0\.up\.weight", ("data", None))])
    with pytest.raises(ShardingError, match=r"blocks\.\*\.up\.weight: the layers are sharded differently"):
        ts.Trainer(model, blocks_loss, optax.sgd(0.1), plan, scan_layers="blocks")


class Odd(BlockStack):
    """BlockStack whose forward breaks the scan protocol in one of several ways."""

    def __init__(self, how):
        super().__init__(depth=3)
        self.how = how

    def forward(self, ids):
        h = self.embed(ids)
        for i, block in enumerate(self.blocks):
            if self.how == "skip" and i == 1:
                continue
            if self.how == "first_two" and i == 2:
                break
            h = block(h * 2 if self.how == "between" and i == 2 else h)
        return self.head(self.norm(h))


class PerLayerArgs(BlockStack):
    def forward(self, ids):
        h = self.embed(ids)
        for i, block in enumerate(self.blocks):
            h = block(h, scale=float(i))
        return self.head(self.norm(h))


class ScaledBlock(Block):
    def forward(self, x, scale=1.0):
        return super().forward(x) * scale


class TwoOutputs(Block):
    def forward(self, x):
        return super().forward(x), x.sum()


def _with_blocks(cls, block_cls):
    model = cls()
    model.blocks = nn.ModuleList(block_cls() for _ in range(3))
    return model


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: Odd("skip"), r"blocks\.2 was called when block 1 was next.*set layerdrop=0"),
        (lambda: Odd("first_two"), r"the model called 2 of the 3 blocks of blocks"),
        (lambda: Odd("between"), r"blocks\.2 got a hidden state that is not block 1's output"),
        (lambda: _with_blocks(PerLayerArgs, ScaledBlock), r"blocks\.1 got other arguments than block 0"),
        (lambda: _with_blocks(BlockStack, TwoOutputs), r"blocks\.0 returned 2 tensor\(s\); a scanned block may return"),
    ],
    ids=["skipped", "not-all", "changed-between", "per-layer-args", "extra-output"],
)
def test_forwards_that_cannot_scan_raise_when_traced(mesh_fsdp, factory, match):
    model = factory()
    trainer = ts.Trainer(model, blocks_loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp), scan_layers="blocks")
    with pytest.raises(ShardingError, match=match):
        trainer.step(batches(64, n=1)[0])


def _default_config_model(family):
    """A transformers model built from its config class's defaults (use_cache=True), only made small."""
    import transformers

    small = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=64, intermediate_size=128, vocab_size=128,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2)),
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    }[family]  # fmt: skip
    config = getattr(transformers, small[0])(**small[2])
    assert config.use_cache
    torch.manual_seed(0)
    return getattr(transformers, small[1])(config)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.slow
def test_a_default_config_with_use_cache_trains_scanned_like_torch(mesh_fsdp, family):
    """A training step never needs the KV cache: the Trainer builds none, whatever the config says."""
    reference = _default_config_model(family)
    model = copy.deepcopy(reference)
    trainer = ts.Trainer(model, llama_loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp), scan_layers=True)
    data = batches(128, n=2)
    got = [float(trainer.step(b)["loss"]) for b in data]
    np.testing.assert_allclose(got, torch_losses(reference, llama_loss, torch.optim.SGD(reference.parameters(), lr=0.1),
                                                 data), rtol=1e-5)  # fmt: skip
    assert model.config.use_cache  # the user's config is as it was


def test_a_kv_cache_asked_for_in_the_call_cannot_go_through_a_scan(mesh_fsdp):
    model = tiny_llama()
    loss = lambda m, ids: m(input_ids=ids, labels=ids, use_cache=True).loss  # noqa: E731
    trainer = ts.Trainer(model, loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp), scan_layers=True)
    with pytest.raises(ShardingError, match=r"model\.layers\.0 got DynamicCache .*drop use_cache=True from the call"):
        trainer.step(batches(128, n=1)[0])


@pytest.mark.slow
def test_scanned_export_has_per_layer_names_and_the_stacked_values():
    trainer = build("llama", "fsdp_tp", scan_layers=True)
    trainer.step(batches(128, n=1)[0])
    exported = ts.to_torch_state_dict(trainer)
    reference = tiny_llama(layers=3)
    assert list(exported) == list(reference.state_dict())
    reference.load_state_dict(exported)
    stacked = trainer.state.params["model.layers.*.mlp.up_proj.weight"]
    assert_close(exported["model.layers.1.mlp.up_proj.weight"], stacked[1], tol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("saved_scanned", "loaded_scanned"), [(True, False), (False, True), (True, True)])
def test_scanned_and_unscanned_checkpoints_load_into_each_other_across_meshes(tmp_path, saved_scanned, loaded_scanned):
    data = batches(64, n=4)
    first = build("blocks", "fsdp", scan_layers=saved_scanned)
    for b in data[:2]:
        first.step(b)
    ts.save(tmp_path, first)
    second = build("blocks", "fsdp_tp", scan_layers=loaded_scanned)
    ts.load(tmp_path, second)
    assert second.step_count == 2
    assert_trees_close(state_of(second.model), state_of(first.model), tol=0)
    np.testing.assert_allclose([float(second.step(b)["loss"]) for b in data[2:]],
                               [float(first.step(b)["loss"]) for b in data[2:]], rtol=1e-5)  # fmt: skip


@pytest.mark.slow
def test_a_scanned_checkpoint_loads_into_a_plain_module(tmp_path, mesh_dm):
    trainer = build("blocks", "fsdp", scan_layers=True)
    trainer.step(batches(64, n=1)[0])
    ts.save(tmp_path, trainer)
    with torch.device("meta"):
        module = BlockStack(depth=4)
    ts.load(tmp_path, module, plan=ts.plan(module, mesh_dm, BLOCK_TP))
    assert_trees_close(state_of(module), state_of(trainer.model), tol=0)


@pytest.mark.slow
def test_a_module_dict_of_identical_layers_scans_like_torch_with_per_layer_names(tmp_path, mesh_fsdp):
    """torchtitan keeps its layers in an nn.ModuleDict ("0".."N-1"): scanned in insertion order."""
    torch.manual_seed(0)
    reference = DictStack()
    data = batches(64, n=3)
    rules = presets.fsdp(min_size=256)
    model = copy.deepcopy(reference)
    trainer = ts.Trainer(model, blocks_loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp, rules), scan_layers=True,
                         remat=r"layers\.\d+")  # fmt: skip
    assert "layers.*.up.weight" in trainer.state.params
    got = [float(trainer.step(b)["loss"]) for b in data[:2]]
    expected = torch_losses(reference, blocks_loss, torch.optim.SGD(reference.parameters(), lr=0.1), data)
    np.testing.assert_allclose(got, expected[:2], rtol=1e-5)
    exported = ts.to_torch_state_dict(trainer)
    assert list(exported) == list(reference.state_dict())
    ts.save(tmp_path, trainer)
    plain = DictStack()
    unscanned = ts.Trainer(plain, blocks_loss, optax.sgd(0.1), ts.plan(plain, mesh_fsdp, rules))
    ts.load(tmp_path, unscanned)
    np.testing.assert_allclose(float(unscanned.step(data[2])["loss"]), expected[2], rtol=1e-5)
