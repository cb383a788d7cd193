"""Activation checkpointing: the same losses and buffers as without it, less memory inside scans, clear errors."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
import torch
from torch import nn

import torchshard as ts
from testsupport.helpers import assert_trees_close, to_numpy, torch_losses
from testsupport.models import BlockStack, RoutedStack, tiny_llama
from torchshard import ShardingError, presets
from torchshard._train.remat import POLICY_NAMES


def blocks_loss(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def batches(n=3, vocab=64):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (8, 12), generator=g) for _ in range(n)]


def trained(model, loss_fn=blocks_loss, data=None, **kwargs):
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), presets.fsdp(min_size=256))
    trainer = ts.Trainer(model, loss_fn, optax.adamw(1e-2), plan, seed=3, **kwargs)
    losses = [float(trainer.step(b)["loss"]) for b in data or batches()]
    return trainer, np.array(losses)


def state_of(module):
    return {k: to_numpy(v) for k, v in module.state_dict().items()}


@functools.cache
def without_remat(scan: bool) -> np.ndarray:
    torch.manual_seed(0)
    return trained(BlockStack(depth=3, dropout=0.2), scan_layers=scan)[1]


@pytest.mark.parametrize(
    ("remat", "scan"),
    [
        (ts.Remat(r"blocks\.\d+", policy="dots_saveable"), False),
        ([r"blocks\.\d+\.up", r"head"], False),
        (ts.Remat(r"blocks\.\d+", policy="dots_with_no_batch_dims_saveable"), True),
        (r"blocks\.\d+\.up", True),
    ],
    ids=["blocks-dots", "submodules", "scan-body", "inside-scan"],
)
@pytest.mark.slow
def test_remat_changes_no_loss_even_with_dropout(remat, scan):
    torch.manual_seed(0)
    _, got = trained(BlockStack(depth=3, dropout=0.2), remat=remat, scan_layers=scan)
    np.testing.assert_allclose(got, without_remat(scan), rtol=1e-6)


class Normed(nn.Module):
    """BatchNorm inside a checkpointed module: its running stats must still be written back."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(11), nn.ReLU())
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


@pytest.mark.slow
def test_buffers_updated_inside_a_checkpoint_are_kept():
    torch.manual_seed(0)
    plain, expected = trained(Normed())
    torch.manual_seed(0)
    checkpointed, got = trained(Normed(), remat="body")
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert_trees_close(state_of(checkpointed.model), state_of(plain.model), tol=1e-6)
    assert float(checkpointed.model.body[1].running_var.jax().min()) != 1.0


@pytest.mark.slow
def test_remat_inside_a_scan_halves_the_compiled_temp_memory_of_an_8_layer_llama():
    def temp(**kwargs):
        model = tiny_llama(layers=8)
        plan = ts.plan(model, ts.make_mesh({"data": 8}), presets.fsdp(min_size=1024))
        trainer = ts.Trainer(model, lambda m, b: m(input_ids=b, labels=b).loss, optax.sgd(0.1), plan, **kwargs)
        return trainer.lower(batches(vocab=128)[0]).compile().memory_analysis().temp_size_in_bytes

    without, remat = temp(scan_layers=True), temp(scan_layers=True, remat=r"model\.layers\.\d+")
    assert remat <= 0.5 * without, f"temp memory {remat} B with remat vs {without} B without"


@pytest.mark.parametrize(
    ("remat", "error", "match"),
    [
        (r"layers\.\d+", ShardingError, r"remat pattern 'layers\\\\.\\\\d\+' matches no module of BlockStack.*closest"),
        ("(", TypeError, r"remat pattern '\(' is not a valid regex"),
        (None, None, None),
        (3, TypeError, r"remat=3 must be a module-name regex, a list of them, or torchshard\.Remat"),
    ],
    ids=["no-match", "bad-regex", "none", "bad-type"],
)
def test_bad_remat_arguments(mesh_fsdp, remat, error, match):
    model = BlockStack(depth=2)
    plan = ts.plan(model, mesh_fsdp)
    if error is None:
        ts.Trainer(model, blocks_loss, optax.sgd(0.1), plan, remat=remat)
        return
    with pytest.raises(error, match=match):
        ts.Trainer(model, blocks_loss, optax.sgd(0.1), plan, remat=remat)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ts.Remat("x", policy="sometimes"), r"remat policy 'sometimes' is not one of \[.*'nothing_saveable'"),
        (lambda: ts.Remat([]), r"remat names no module pattern"),
        (lambda: ts.Remat([3]), r"remat pattern 3 is not a string"),
        (lambda: ts.Remat("x", policy=3), r"remat policy 3 is not one of \['dots_saveable', .*'matmuls'\] or a "
                                          r"function policy\(prim, \*avals, \*\*params\) -> bool"),
        (lambda: ts.Remat("x", policy=int), r"remat policy <class 'int'> is a class, not a policy function; use one "
                                            r"of \[.*'nothing_saveable'.*'matmuls'\]"),
        (lambda: ts.Remat("x", policy=jax.checkpoint_policies.save_only_these_names),
         r"remat policy <function save_only_these_names.* cannot be called as policy\(prim, \*avals, \*\*params\)"),
        (lambda: ts.Remat("x", policy=lambda: True), r"cannot be called as policy\(prim, \*avals, \*\*params\)"),
    ],
    ids=["policy", "empty", "not-a-string", "number", "class", "policy-factory", "no-arguments"],
)  # fmt: skip
def test_bad_remat_specs(make, match):
    with pytest.raises(ts.ArgumentError, match=match):
        make()


@pytest.mark.parametrize(
    "policy",
    [*POLICY_NAMES, jax.checkpoint_policies.dots_saveable, lambda prim, *avals, **params: False],
    ids=[*POLICY_NAMES, "jax-policy", "lambda"],
)
def test_every_policy_name_and_policy_function_is_taken(policy):
    assert ts.Remat("x", policy=policy).policy is policy


def test_remat_must_treat_every_scanned_block_alike(mesh_fsdp):
    model = BlockStack(depth=3)
    plan = ts.plan(model, mesh_fsdp)
    with pytest.raises(ShardingError, match=r"remat names \['blocks\.1'\] but not every block of the scanned blocks"):
        ts.Trainer(model, blocks_loss, optax.sgd(0.1), plan, remat=r"blocks\.1", scan_layers=True)
    with pytest.raises(ShardingError, match=r"remat names blocks\.0\.up but not the same module of every block"):
        ts.Trainer(model, blocks_loss, optax.sgd(0.1), plan, remat=r"blocks\.0\.up", scan_layers=True)


def test_the_outermost_match_is_checkpointed(mesh_fsdp):
    from torchshard._train.remat import remat_targets

    targets = remat_targets(BlockStack(depth=2), ts.Remat([r"blocks\.\d+", r"blocks\.\d+\.up"]))
    assert targets == ["blocks.0", "blocks.1"]


def routed_loss(model, ids):
    logits, aux = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)) + aux


@pytest.mark.parametrize(
    "kwargs",
    [dict(remat=r"blocks\.\d+"), dict(scan_layers=True), dict(scan_layers=True, remat=r"blocks\.\d+")],
    ids=["remat", "scan", "scan+remat"],
)
@pytest.mark.slow
def test_outputs_forward_hooks_collect_inside_a_body_reach_the_loss_like_torch(kwargs):
    """Hooks that collect a submodule's output (MoE router logits for the aux loss) run inside the
    checkpointed / scanned body: their tensors are carried out of it, not leaked as tracers."""
    torch.manual_seed(0)
    reference = RoutedStack()
    model = RoutedStack()
    model.load_state_dict(reference.state_dict())
    data = batches(n=2)
    plan = ts.plan(model, ts.make_mesh({"data": 8}))
    trainer = ts.Trainer(model, routed_loss, optax.sgd(0.1), plan, **kwargs)
    got = [float(trainer.step(b)["loss"]) for b in data]
    expected = torch_losses(reference, routed_loss, torch.optim.SGD(reference.parameters(), lr=0.1), data)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert_trees_close(state_of(trainer.model), state_of(reference), tol=1e-5)


def test_a_forward_hook_that_replaces_an_output_inside_a_body_is_an_error():
    model = BlockStack(depth=2)
    model.blocks[0].up.register_forward_hook(lambda module, args, out: out * 2)
    model.blocks[1].up.register_forward_hook(lambda module, args, out: out * 2)
    trainer = ts.Trainer(model, blocks_loss, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})),
                         remat=r"blocks\.\d+")  # fmt: skip
    with pytest.raises(ShardingError, match=r"a forward hook of Linear .* returns a new output.*register it on a"):
        trainer.step(batches(n=1)[0])


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [("qwen3_moe", dict(remat=r"model\.layers\.\d+")), ("mixtral", dict(scan_layers=True))],
)
@pytest.mark.slow
def test_moe_router_logits_train_the_aux_loss_under_remat_and_scan_like_torch(family, kwargs):
    """transformers collects router logits with forward hooks (output_router_logits=True): under remat or
    scan_layers they leaked out of the body as tracers (UnexpectedTracerError)."""
    import copy

    from tools.families import build, loss_and_aux, with_router_logits

    reference = build(with_router_logits(family))
    model = copy.deepcopy(reference)

    g = torch.Generator().manual_seed(0)  # batches whose top-2 routing has no near-tie (a flip moves the aux loss)
    data = [torch.randint(0, 128, (8, 16), generator=g) for _ in range(2)]
    trainer = ts.Trainer(model, loss_and_aux, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})), **kwargs)
    got = [trainer.step(b) for b in data]
    expected = torch_losses(reference, lambda m, ids: loss_and_aux(m, ids)[0],
                            torch.optim.SGD(reference.parameters(), lr=0.1), data)  # fmt: skip
    np.testing.assert_allclose([float(m["loss"]) for m in got], expected, rtol=1e-5)
    with torch.no_grad():
        aux = float(reference(input_ids=data[0], labels=data[0]).aux_loss)
    assert float(got[0]["aux_loss"]) > 0.1 and aux > 0.1  # the aux loss takes part


@pytest.mark.slow
def test_the_matmuls_policy_recomputes_no_matmul_against_a_weight_and_trains_like_eager(mesh_fsdp):
    """remat=Remat(layers, policy="matmuls") keeps each matmul against a weight and recomputes the cheap rest and
    attention's forward, where nothing_saveable recomputes every matmul of the forward."""

    def run(policy: str | None) -> ts.Trainer:
        torch.manual_seed(0)
        model = tiny_llama(layers=2)
        remat = None if policy is None else ts.Remat(r"model\.layers\.\d+", policy=policy)
        loss = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
        return ts.Trainer(model, loss, optax.adamw(1e-3), ts.plan(model, mesh_fsdp), scan_layers=True, remat=remat)

    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 128, (8, 64), generator=g) for _ in range(3)]
    torch.manual_seed(0)
    ref = tiny_llama(layers=2)
    expected = torch_losses(ref, lambda m, ids: m(input_ids=ids, labels=ids).loss,
                            torch.optim.AdamW(ref.parameters(), lr=1e-3), data)  # fmt: skip
    kept, recomputed, plain = run("matmuls"), run("nothing_saveable"), run(None)
    np.testing.assert_allclose([float(kept.step(b)["loss"]) for b in data], expected, rtol=1e-4)
    recomputed.step(data[0])
    plain.step(data[0])
    # matmul FLOPs remat added (the tiled attention's backward recomputes its scores with or without remat):
    # nothing_saveable recomputes the projections and MLP, "matmuls" only attention's forward scores
    added = lambda t: t.flops_per_step - t.model_flops_per_step - (plain.flops_per_step - plain.model_flops_per_step)  # noqa: E731
    assert added(recomputed) > 0.2 * plain.model_flops_per_step
    assert 0 < added(kept) < 0.05 * plain.model_flops_per_step, (added(kept), plain.model_flops_per_step)
