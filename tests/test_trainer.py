"""Trainer against eager, unsharded torch: SGD, AdamW, accumulation, ties, buffers, dropout, errors."""

from __future__ import annotations

import copy

import jax
import numpy as np
import optax
import pytest
import torch
import torchax
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard as ts
from testsupport.helpers import assert_close, assert_trees_close, to_numpy, torch_losses
from testsupport.models import MLP, Block, TiedLM
from torchshard import presets

TP_MLP = presets.tensor_parallel(colwise=[r"layers\.0", r"layers\.2"], rowwise=[r"layers\.1"])
PLANS = {
    "dp": lambda: presets.data_parallel(),
    "tp": lambda: TP_MLP,
    "fsdp": lambda: presets.fsdp(min_size=64),
    "fsdp+tp": lambda: TP_MLP + presets.fsdp(min_size=64),
}
MESHES = {"data4_model2": {"data": 4, "model": 2}, "data8": {"data": 8}}


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def lm_loss(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def pair(factory, seed=0):
    """A reference model and an identical copy to shard."""
    torch.manual_seed(seed)
    ref = factory()
    return ref, copy.deepcopy(ref)


def mlp_batches(n, batch=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 32, generator=g), torch.randn(batch, 16, generator=g)) for _ in range(n)]


def state_of(module):
    return {k: to_numpy(v) for k, v in module.state_dict().items()}


def make_trainer(model, loss_fn, opt, mesh_axes, rules, **kwargs):
    mesh = ts.make_mesh(mesh_axes)
    return ts.Trainer(model, loss_fn, opt, ts.plan(model, mesh, rules), **kwargs)


def combos(plan_names):
    """(plan, mesh) pairs; tensor-parallel plans only on meshes with a 'model' axis."""
    return [(p, m) for p in plan_names for m in MESHES if "tp" not in p or "model" in MESHES[m]]


@pytest.mark.parametrize(("plan_name", "mesh_name"), combos(PLANS))
def test_sgd_params_after_10_steps_match_torch(plan_name, mesh_name):
    ref, model = pair(MLP)
    batches = mlp_batches(10)
    trainer = make_trainer(model, mse, optax.sgd(0.05), MESHES[mesh_name], PLANS[plan_name]())
    losses = [trainer.step(b)["loss"] for b in batches]
    expected = torch_losses(ref, mse, torch.optim.SGD(ref.parameters(), lr=0.05), batches)
    assert_trees_close(state_of(trainer.model), state_of(ref), tol=1e-5)
    assert_close(np.array([float(v) for v in losses]), np.array(expected), tol=1e-5, what="losses")


@pytest.mark.parametrize(("plan_name", "mesh_name"), combos(["dp", "fsdp", "fsdp+tp"]))
def test_adamw_loss_trajectory_matches_torch(plan_name, mesh_name):
    ref, model = pair(MLP)
    batches = mlp_batches(8)
    trainer = make_trainer(model, mse, optax.adamw(1e-2, weight_decay=0.1), MESHES[mesh_name], PLANS[plan_name]())
    got = np.array([float(trainer.step(b)["loss"]) for b in batches])
    expected = torch_losses(ref, mse, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), batches)
    np.testing.assert_allclose(got, expected, rtol=1e-4)


@pytest.mark.parametrize("mesh_name", MESHES)
def test_grad_accumulation_gives_the_same_update(mesh_name):
    rules = presets.fsdp(min_size=64)
    _, one = pair(MLP)
    _, two = pair(MLP)
    batches = mlp_batches(3, batch=32)
    t1 = make_trainer(one, mse, optax.sgd(0.1), MESHES[mesh_name], rules)
    t2 = make_trainer(two, mse, optax.sgd(0.1), MESHES[mesh_name], rules, grad_accum_steps=2)
    for b in batches:
        assert_close(t2.step(b)["loss"], t1.step(b)["loss"], tol=1e-5, what="loss")
    assert_trees_close(state_of(t2.model), state_of(t1.model), tol=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_tied_embedding_trains_as_one_tensor(optimizer):
    ref, model = pair(TiedLM)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (8, 8), generator=g) for _ in range(4)]
    rules = presets.tensor_parallel(colwise=["block.up"], rowwise=["block.down"]) + presets.fsdp(min_size=256)
    opts = {
        "sgd": (optax.sgd(0.5), torch.optim.SGD(ref.parameters(), lr=0.5)),
        "adamw": (
            optax.adamw(1e-2, weight_decay=0.01),
            torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01),
        ),
    }
    trainer = make_trainer(model, lm_loss, opts[optimizer][0], MESHES["data4_model2"], rules)
    got = np.array([float(trainer.step(b)["loss"]) for b in batches])
    expected = torch_losses(ref, lm_loss, opts[optimizer][1], batches)
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    assert trainer.model.head.weight is trainer.model.embed.weight
    assert "head.weight" not in trainer.state.params
    assert_trees_close(state_of(trainer.model), state_of(ref), tol=1e-4)


def test_shardings_stay_pinned_to_the_plan_and_optimizer_state_follows_params():
    _, model = pair(MLP)
    mesh = ts.make_mesh(MESHES["data4_model2"])
    plan = ts.plan(model, mesh, TP_MLP + presets.fsdp(min_size=64))
    trainer = ts.Trainer(model, mse, optax.adamw(1e-3), plan)
    for b in mlp_batches(5):
        trainer.step(b)
    for name, tensor in trainer.model.state_dict().items():
        assert tensor.jax().sharding == plan[name], name
    adam = trainer.state.opt_state[0]
    for moments in (adam.mu, adam.nu):
        for name, leaf in moments.items():
            assert leaf.sharding == plan[name], name
    assert trainer.step_count == 5


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param(lambda x, y: (x, y), id="tuple"),
        pytest.param(lambda x, y: {"x": x, "y": y}, id="dict"),
        pytest.param(lambda x, y: torch.cat([x, y], 1), id="tensor"),
    ],
)
def test_batch_pytrees(batch):
    def loss_fn(model, b):
        if isinstance(b, dict):
            return mse(model, (b["x"], b["y"]))
        if isinstance(b, torch.Tensor):
            return mse(model, (b[:, :32], b[:, 32:]))
        return mse(model, b)

    ref, model = pair(MLP)
    ((x, y),) = mlp_batches(1)
    trainer = make_trainer(model, loss_fn, optax.sgd(0.1), MESHES["data8"], presets.data_parallel())
    assert_close(trainer.step(batch(x, y))["loss"], mse(ref, (x, y)), tol=1e-5, what="loss")


def test_already_placed_batch_is_accepted():
    ref, model = pair(MLP)
    ((x, y),) = mlp_batches(1)
    trainer = make_trainer(model, mse, optax.sgd(0.1), MESHES["data8"], presets.data_parallel())
    placed = trainer.place_batch((x, y))
    assert placed[0].sharding.spec == jax.sharding.PartitionSpec("data")
    assert_close(trainer.step(placed)["loss"], mse(ref, (x, y)), tol=1e-5, what="loss")


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_batchnorm_running_stats_are_carried_and_updated():
    ref, model = pair(Normed)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)) for _ in range(3)]
    trainer = make_trainer(model, mse, optax.sgd(0.1), MESHES["data8"], presets.data_parallel())
    for b in batches:
        trainer.step(b)
    torch_losses(ref, mse, torch.optim.SGD(ref.parameters(), lr=0.1), batches)
    assert_trees_close(state_of(trainer.model), state_of(ref), tol=1e-5)
    assert int(to_numpy(trainer.model.bn.num_batches_tracked)) == 3


def test_readme_path_plan_shard_trainer_trains_batchnorm_like_torch():
    """The Quick start's plan → shard → Trainer with BatchNorm: shard() narrows num_batches_tracked to int32,
    and the Trainer's second look at the plan must accept what shard() placed (it once called it re-typed)."""
    ref, model = pair(lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8)))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)) for _ in range(3)]
    mesh = ts.make_mesh(MESHES["data4_model2"])
    rules = presets.tensor_parallel(colwise=["0"], rowwise=["3"]) + presets.fsdp("data", min_size=64)
    plan = ts.plan(model, mesh, rules)
    ts.shard(model, plan)
    trainer = ts.Trainer(model, mse, optax.sgd(0.1), plan)
    losses = [float(trainer.step(b)["loss"]) for b in batches]
    expected = torch_losses(ref, mse, torch.optim.SGD(ref.parameters(), lr=0.1), batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    exported = ts.to_torch_state_dict(trainer)
    assert exported["1.num_batches_tracked"].dtype == torch.int64 and int(exported["1.num_batches_tracked"]) == 3
    assert_trees_close({k: to_numpy(v) for k, v in exported.items()}, state_of(ref), tol=1e-5)


class DropoutProbe(nn.Module):
    """Records the dropout mask of its input in a buffer sharded over the batch."""

    shard_rules = [("mask", ("data", None))]

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))
        self.register_buffer("mask", torch.zeros(16, 8))

    def forward(self, x):
        out = nn.functional.dropout(x * self.w, p=0.5, training=True)
        self.mask.copy_((out != 0).float())
        return out


def masks(seed, steps=2):
    trainer = make_trainer(DropoutProbe(), lambda m, x: m(x).sum(), optax.sgd(0.0), MESHES["data8"], None, seed=seed)
    out = []
    for _ in range(steps):
        trainer.step(torch.ones(16, 8))
        out.append(to_numpy(trainer.model.mask))
    return out


def test_dropout_masks_differ_across_data_shards_and_steps_and_repeat_with_the_seed():
    first, second = masks(seed=0)
    per_device = first.reshape(8, 2 * 8)
    assert len({row.tobytes() for row in per_device}) == 8, "data shards drew identical masks"
    assert not np.array_equal(first, second), "two steps drew the same mask"
    again = masks(seed=0)
    np.testing.assert_array_equal(again[0], first)
    np.testing.assert_array_equal(again[1], second)
    assert not np.array_equal(masks(seed=1)[0], first)
    assert 0.3 < first.mean() < 0.7


def test_many_steps_without_reading_the_loss_complete():
    _, model = pair(MLP)
    trainer = make_trainer(model, mse, optax.adamw(1e-3), MESHES["data4_model2"], TP_MLP + presets.fsdp(min_size=64))
    batch = mlp_batches(1)[0]
    for _ in range(200):
        trainer.step(batch)
    assert trainer.step_count == 200
    assert np.isfinite(float(trainer.step(batch)["loss"]))


@pytest.mark.slow
def test_trained_model_runs_inference_and_exports_state():
    ref, model = pair(Block)
    x = torch.randn(8, 4, 32)
    trainer = make_trainer(model, lambda m, b: m(b).pow(2).mean(), optax.sgd(0.1), MESHES["data8"], None)
    for _ in range(3):
        trainer.step(x)
    torch_losses(ref, lambda m, b: m(b).pow(2).mean(), torch.optim.SGD(ref.parameters(), lr=0.1), [x] * 3)
    with torchax.default_env():
        out = trainer.model(torchax.interop.torch_view(trainer.place_batch(x)))
    assert_close(out, ref(x), tol=1e-5, what="inference after training")


@pytest.mark.parametrize(
    ("batch", "kwargs", "match"),
    [
        ((torch.randn(12, 32), torch.randn(12, 16)), {}, r"dim 0 \(size 12\) is not divisible by data \(size 8\)"),
        (
            (torch.randn(24, 32), torch.randn(24, 16)),
            {"grad_accum_steps": 2},
            r"size 24.*grad_accum_steps 2; use a batch size that is a multiple of 16",
        ),
    ],
)
def test_bad_batch_sizes_raise(batch, kwargs, match):
    _, model = pair(MLP)
    trainer = make_trainer(model, mse, optax.sgd(0.1), MESHES["data8"], None, **kwargs)
    with pytest.raises(ts.ShardingError, match=match):
        trainer.step(batch)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((), {"grad_accum_steps": 0}, r"grad_accum_steps=0 must be an int ≥ 1"),
        ((), {"grad_accum_steps": True}, r"grad_accum_steps=True must be an int ≥ 1"),
        ((), {"batch_spec": ("batch",)}, r"batch_spec axis 'batch' is not in the mesh \['data'\]"),
        ((), {"batch_spec": lambda info: P()}, r"batch_spec=<function .*> is not a PartitionSpec"),
        ((), {"max_in_flight": 0}, r"max_in_flight=0"),
        ((), {"max_in_flight": 32}, r"max_in_flight=32: XLA on CPU aborts with ~30 steps queued; use at most 16"),
        ((), {"donate": "yes", "seed": -1}, r"(?s)seed=-1 must be an int ≥ 0.*donate='yes' must be True or False"),
        ((mse, torch.optim.SGD([torch.zeros(1)], lr=0.1)), {}, r"1 parameter\(s\) of the optimizer are not MLP's"),
        ((mse, optax.adam), {}, r"optimizer is the function adam, not a GradientTransformation; call it"),
        (("mse", optax.sgd(0.1)), {}, r"loss_fn must be a function loss_fn\(model, batch\), got 'mse'"),
        ((mse, optax.sgd(0.1)), {"remat": 3}, r"remat=3 must be a module-name regex"),
    ],
    ids=["accum-0", "accum-bool", "batch-axis", "batch-spec-fn", "in-flight-0", "in-flight-cpu", "flags",
         "torch-optimizer", "uncalled-optax", "loss-not-callable", "remat-type"],
)  # fmt: skip
def test_bad_trainer_arguments_raise_before_anything_moves(args, kwargs, match):
    _, model = pair(MLP)
    loss_fn, opt = args or (mse, optax.sgd(0.1))
    with pytest.raises(ts.ArgumentError, match=match):
        make_trainer(model, loss_fn, opt, MESHES["data8"], None, **kwargs)
    assert all(type(t) is torch.Tensor for t in model.state_dict().values())


@pytest.mark.parametrize(
    ("loss_fn", "match"),
    [
        (lambda m, b: 3, r"loss_fn returned a int \(3\) as the loss; return the loss tensor"),
        (lambda m, b: 0.5, r"loss_fn returned a float \(0\.5\) as the loss"),
        (lambda m, b: None, r"loss_fn returned a NoneType \(None\) as the loss"),
        (
            lambda m, b: mse(m, b).item(),
            r"loss_fn: loss_fn turns a traced tensor into a Python value \(if/while on a tensor, bool\(\), int",
        ),
        (lambda m, b: (mse(m, b), 1.0), r"loss_fn returned a tuple of 2; return the loss tensor, or \(loss, \{name"),
        (lambda m, b: (mse(m, b), {"loss": mse(m, b)}), r"metric 'loss' would replace the step's own 'loss'"),
        (lambda m, b: (mse(m, b), {"x": m(b[0])}), r"metric 'x' has shape \(16, 16\); metrics are scalars"),
        (lambda m, b: (mse(m, b), {"x": "high"}), r"metric 'x' is a str \('high'\); metrics are scalar tensors"),
        (lambda m, b: m(b[0]).sum().int(), r"must return a floating scalar loss, got a int32 tensor"),
    ],
    ids=["int", "float", "none", "item", "tuple-no-dict", "aux-loss", "aux-not-scalar", "aux-str", "int-loss"],
)
def test_loss_functions_that_return_no_loss_tensor_raise(loss_fn, match):
    _, model = pair(MLP)
    trainer = make_trainer(model, loss_fn, optax.sgd(0.1), MESHES["data8"], None)
    with pytest.raises(ts.ShardingError, match=match):
        trainer.step(mlp_batches(1)[0])


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ("some text", ts.ArgumentError, r"batch leaf #0 is a str \('some text'\); batches hold tensors or arrays"),
        ((torch.zeros(0, 32), torch.zeros(0, 16)), ts.ArgumentError, r"batch leaf #0 \(0, 32\) has no rows"),
        ((torch.empty(16, 32, device="meta"), torch.zeros(16, 16)), ts.ArgumentError, r"#0 \(16, 32\) is on the meta"),
        ((torch.randn(16, 31), torch.randn(16, 16)), ts.ShardingError,
         r"loss_fn failed in Linear 'layers\.0' on batch leaves #0 float32\[16, 31\], #1 float32\[16, 16\]: "
         r"ValueError: F\.linear: mat1 and mat2 shapes cannot be multiplied: input \(16, 31\) has 31 features, "
         r"the weight \(64, 32\) takes 32; check the batch's shapes and dtypes against the model"),
        ((torch.ones(16, 32, dtype=torch.int64), torch.randn(16, 16)), ts.ShardingError,
         r"F\.linear of a int32\[16, 32\] and a float32\[64, 32\] operand: torch refuses mixed integer/floating"),
    ],
    ids=["string", "no-rows", "meta", "wrong-features", "int-into-float"],
)  # fmt: skip
def test_bad_batches_name_the_leaf(batch, error, match):
    _, model = pair(MLP)
    trainer = make_trainer(model, mse, optax.sgd(0.1), MESHES["data8"], None)
    with pytest.raises(error, match=match):
        trainer.step(batch)


def test_skip_nonfinite_leaves_the_state_alone_and_says_so():
    _, model = pair(MLP)
    trainer = make_trainer(model, mse, optax.adamw(1e-2), MESHES["data8"], None, skip_nonfinite=True)
    (x, y), good = mlp_batches(2)
    trainer.step(good)
    before = jax.tree.map(np.asarray, trainer.state._replace(step=0))
    x[3, 5] = float("nan")
    metrics = trainer.step((x, y))
    assert float(metrics["skipped"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, trainer.state._replace(step=0)), before)
    assert float(trainer.step(good)["skipped"]) == 0.0 and trainer.step_count == 3
    assert not np.array_equal(np.asarray(trainer.state.params["layers.0.weight"]), before.params["layers.0.weight"])


@pytest.mark.parametrize("donate", [True, False])
def test_steps_from_several_threads_run_one_at_a_time_and_none_is_lost(donate):
    import threading

    _, model = pair(MLP)
    trainer = make_trainer(model, mse, optax.sgd(0.01), MESHES["data8"], None, donate=donate)
    batch = mlp_batches(1)[0]
    trainer.step(batch)
    threads = [threading.Thread(target=lambda: [trainer.step(batch) for _ in range(5)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert trainer.step_count == 21
    assert np.isfinite(float(trainer.step(batch)["loss"]))


def test_a_second_trainer_takes_the_module_over():
    ref, model = pair(MLP)
    first = make_trainer(model, mse, optax.sgd(0.1), MESHES["data8"], None)
    batches = mlp_batches(2)
    first.step(batches[0])
    second = make_trainer(first.model, mse, optax.sgd(0.1), MESHES["data4_model2"], TP_MLP)
    second.step(batches[1])
    torch_losses(ref, mse, torch.optim.SGD(ref.parameters(), lr=0.1), batches)
    assert_trees_close(state_of(second.model), state_of(ref), tol=1e-5)
    with pytest.raises(ts.ShardingError, match=r"another Trainer has been built on this Trainer's module since"):
        first.step(batches[0])


class LayerDrop(nn.Module):
    """Skips its block at random, as LayerDrop does: a Python decision on a random tensor."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        if torch.rand([]) < 0.5:
            return x
        return self.block(x)


def test_python_decisions_on_random_tensors_are_not_frozen_silently(mesh_fsdp):
    model = nn.Sequential(LayerDrop())
    trainer = ts.Trainer(model, lambda m, x: m(x).sum(), optax.sgd(0.1), ts.plan(model, mesh_fsdp))
    with pytest.raises(ts.ShardingError, match=r"loss_fn: LayerDrop '0' turns a traced tensor into a Python value.*"
                                               r"torch\.where.*layerdrop=0"):  # fmt: skip
        trainer.step(torch.randn(8, 4, 32))


def test_non_scalar_loss_raises():
    _, model = pair(MLP)
    trainer = make_trainer(model, lambda m, b: m(b[0]), optax.sgd(0.1), MESHES["data8"], None)
    with pytest.raises(ts.ShardingError, match=r"scalar loss.*shape \(16, 16\)"):
        trainer.step(mlp_batches(1)[0])


class LoopMoE(nn.Module):
    """The textbook MoE loop: each expert gathers the tokens that chose it, a shape only their values fix."""

    def __init__(self, select):
        super().__init__()
        self.select = select
        self.router = nn.Linear(32, 4)
        self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        weights, top_k_index = torch.topk(self.router(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if self.select == "mask":
                chosen = (top_k_index == e).any(-1)
                out[chosen] += expert(x[chosen])
                continue
            mask = top_k_index == e
            idx, k = torch.where(mask) if self.select == "where" else mask.nonzero(as_tuple=True)
            out = out.index_add(0, idx, weights[idx, k, None] * expert(x[idx]))
        return out


@pytest.mark.parametrize(
    ("select", "call"),
    [("where", r"torch\.nonzero \(what one-argument torch\.where\(mask\) and \.nonzero\(\) run\)"),
     ("nonzero", r"torch\.nonzero \(what one-argument"),
     ("mask", r"indexing with a boolean mask \(x\[mask\]\)")],
    ids=["where", "nonzero", "mask"],
)  # fmt: skip
def test_the_textbook_moe_loop_is_named_a_data_dependent_shape_with_the_static_form(mesh_fsdp, select, call):
    model = LoopMoE(select)
    trainer = ts.Trainer(model, lambda m, x: m(x).square().mean(), optax.sgd(0.1), ts.plan(model, mesh_fsdp))
    with pytest.raises(ts.ShardingError, match=rf"loss_fn: LoopMoE '\(the model\)' uses {call}.*, a data-dependent "
                                               r"shape: .*torch\.where\(mask, x, 0\) with three arguments.*"
                                               r"top_k_index == e.*ExpertDispatch") as caught:  # fmt: skip
        trainer.step(torch.randn(16, 32))
    assert "instead of if" not in str(caught.value)


class _RescalesItself(nn.Module):
    """RWKV's pattern: the forward writes a weight in place under no_grad (on a mode switch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x)


def test_a_forward_that_writes_its_parameters_is_refused_before_anything_changes():
    model = _RescalesItself()
    plan = ts.plan(model, ts.make_mesh({"data": 8}), presets.fsdp(min_size=0))
    trainer = ts.Trainer(model, lambda m, x: m(x).square().mean(), optax.sgd(0.1), plan)
    before = ts.to_torch_state_dict(trainer)
    with pytest.raises(ts.ShardingError, match=r"_RescalesItself's forward writes parameter\(s\) lin.weight in place"):
        trainer.step(torch.randn(8, 8))
    assert trainer.step_count == 0
    for name, value in ts.to_torch_state_dict(trainer).items():
        assert torch.equal(value, before[name]), name
