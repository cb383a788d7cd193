"""Placement: sharded forward equals eager torch; shardings follow the plan; constrain; sharded init."""

import copy

import jax
import numpy as np
import pytest
import torch
import torchax
import torchax.interop
from helpers import assert_close, assert_trees_close, to_numpy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import MLP, Block, TiedLM
from torch import nn

import torchshard
from torchshard import ShardingError, presets
from torchshard._placement import put
from torchshard._torchax import wrap

MODELS = {
    "mlp": (lambda: MLP((32, 64, 64, 16)), lambda g: torch.randn(8, 32, generator=g)),
    "block": (Block, lambda g: torch.randn(8, 4, 32, generator=g)),
    "tiedlm": (TiedLM, lambda g: torch.randint(0, 64, (8, 8), generator=g)),
}
TP = {  # column-parallel then row-parallel, alternating
    "mlp": {"colwise": [r"layers\.[02]"], "rowwise": [r"layers\.1"]},
    "block": {"colwise": ["up"], "rowwise": ["down"]},
    "tiedlm": {"colwise": [r"block\.up"], "rowwise": [r"block\.down", "embed"]},  # head is tied: colwise
}
PLANS = {
    "replicated": lambda tp: presets.replicated(),
    "fsdp": lambda tp: presets.fsdp(min_size=16),
    "tp": lambda tp: presets.tensor_parallel(**tp),
    "fsdp+tp": lambda tp: presets.tensor_parallel(**tp) + presets.fsdp(min_size=16),
}


def _tensors(model):
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def _batch(x, mesh):
    return torchshard.shard_batch(x, mesh)


def _jit_forward(model):
    params = dict(model.named_parameters()) | dict(model.named_buffers())  # one entry per tied tensor
    forward = torchax.interop.jax_jit(lambda p, x: torch.func.functional_call(model, p, (x,)))
    return lambda x: forward(params, x)


def _eager_forward(model):
    def forward(x):
        with torchax.default_env():
            return model(x)

    return forward


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_sharded_forward_matches_eager_torch(mesh_dm, model_name, plan_name, mode):
    model_fn, input_fn = MODELS[model_name]
    torch.manual_seed(0)
    model = model_fn()
    x = input_fn(torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    plan = torchshard.plan(model, mesh_dm, PLANS[plan_name](TP[model_name]))
    assert torchshard.shard(model, plan) is model
    for name, tensor in _tensors(model).items():
        assert tensor.jax().sharding.spec == plan.spec(name), name
        assert tensor.jax().sharding.mesh == mesh_dm
    forward = _jit_forward(model) if mode == "jit" else _eager_forward(model)
    assert_close(forward(_batch(x, mesh_dm)), expected, what=f"{model_name}/{plan_name}/{mode}")


def test_plans_shard_something(mesh_dm):
    # guards the test above against plans that silently replicate everything
    for model_name, (model_fn, _) in MODELS.items():
        for plan_name in ("fsdp", "tp", "fsdp+tp"):
            plan = torchshard.plan(model_fn(), mesh_dm, PLANS[plan_name](TP[model_name]))
            assert plan.bytes_per_device() < plan.total_bytes(), (model_name, plan_name)


def test_shard_keeps_ties_and_parameter_types(mesh_dm):
    model = TiedLM()
    model.block.up.bias.requires_grad_(False)
    torchshard.shard(model, torchshard.plan(model, mesh_dm, PLANS["fsdp+tp"](TP["tiedlm"])))
    assert model.head.weight is model.embed.weight
    assert isinstance(model.embed.weight, nn.Parameter)
    assert isinstance(model.embed.weight, torchax.tensor.Tensor)
    assert model.embed.weight.requires_grad
    assert not model.block.up.bias.requires_grad
    assert not isinstance(model.pos, nn.Parameter)
    assert isinstance(model.pos, torchax.tensor.Tensor)
    assert [name for name, _ in model.named_parameters()].count("head.weight") == 0  # still deduplicated


def test_shard_with_a_plan_made_on_meta(mesh_dm):
    with torch.device("meta"):
        plan = torchshard.plan(TiedLM(), mesh_dm, PLANS["fsdp+tp"](TP["tiedlm"]))
    model = TiedLM()
    expected = model.state_dict()
    torchshard.shard(model, plan)
    assert_trees_close(model.state_dict(), expected)
    assert model.embed.weight.jax().sharding.spec == P("model", "data")


def test_reshard_a_placed_model(mesh_dm, mesh_fsdp):
    model = MLP()
    expected = copy.deepcopy(model.state_dict())
    torchshard.shard(model, torchshard.plan(model, mesh_dm, PLANS["tp"](TP["mlp"])))
    plan = torchshard.plan(model, mesh_fsdp, presets.fsdp(min_size=16))
    torchshard.shard(model, plan)
    for name, tensor in _tensors(model).items():
        assert tensor.jax().sharding == plan[name], name
    assert_trees_close(model.state_dict(), expected)


@pytest.mark.parametrize(
    ("model_fn", "plan_fn", "match"),
    [
        (
            Block,
            lambda mesh: torchshard.plan(MLP(), mesh),
            r"(?s)plan does not fit Block; re-run plan\(\) on this model after changing it \(12 problems\).*"
            r"missing layers\.0\.weight \(64, 32\): in the plan, not in the model.*"
            r"unexpected norm\.weight \(32,\): in the model, not in the plan",
        ),
        (
            lambda: MLP((32, 64, 64, 8)),
            lambda mesh: torchshard.plan(MLP((32, 64, 64, 16)), mesh),
            r"(?s)plan does not fit MLP.*\(2 problems\).*mis-shaped layers\.2\.weight: model \(8, 64\), plan "
            r"\(16, 64\).*mis-shaped layers\.2\.bias: model \(8,\), plan \(16,\)",
        ),
    ],
    ids=["other-model", "other-shapes"],
)
def test_shard_rejects_a_plan_of_another_model(mesh_dm, model_fn, plan_fn, match):
    with pytest.raises(ShardingError, match=match):
        torchshard.shard(model_fn(), plan_fn(mesh_dm))


def test_shard_rejects_meta_tensors(mesh_dm):
    with torch.device("meta"):
        model = MLP()
    plan = torchshard.plan(model, mesh_dm)
    with pytest.raises(
        ShardingError, match=r"layers\.0\.weight \(64, 32\): on the meta device \(no values\); use init_sharded"
    ):
        torchshard.shard(model, plan)


# --- constrain ----------------------------------------------------------------------------------


def test_constrain_returns_plain_torch_tensors_unchanged(mesh_dm):
    x = torch.randn(8, 4)
    assert torchshard.constrain(x, ("data", None), mesh_dm) is x
    assert torchshard.constrain(x, ("data", None)) is x  # no mesh needed either


@pytest.mark.parametrize("spec", [("data", None), P(None, "model"), (("data", "model"),), None])
def test_constrain_eager(mesh_dm, spec):
    x = torch.randn(8, 4)
    placed = wrap(put(x, NamedSharding(mesh_dm, P())))
    out = torchshard.constrain(placed, spec, mesh_dm)
    assert out.jax().sharding.is_equivalent_to(NamedSharding(mesh_dm, P() if spec is None else P(*spec)), 2)
    assert_close(out, x)


def test_constrain_under_jit(mesh_dm):
    x = torch.randn(8, 4)
    placed = wrap(put(x, NamedSharding(mesh_dm, P())))

    def double(t):
        return torchshard.constrain(t * 2, (None, "model"), mesh_dm)

    jaxpr = jax.jit(torchax.interop.jax_view(double)).trace(placed.jax()).jaxpr
    assert "sharding_constraint" in str(jaxpr)  # a constraint, not a transfer
    out = torchax.interop.jax_jit(double)(placed)
    assert out.jax().sharding.is_equivalent_to(NamedSharding(mesh_dm, P(None, "model")), 2)
    assert_close(out, 2 * x)


def test_constrain_uses_the_ambient_mesh(mesh_dm):
    x = torch.randn(8, 4)
    placed = wrap(put(x, NamedSharding(mesh_dm, P())))
    with jax.set_mesh(mesh_dm):
        eager = torchshard.constrain(placed, ("data", None))
        jitted = torchax.interop.jax_jit(lambda t: torchshard.constrain(t + 1, ("data", "model")))(placed)
    assert eager.jax().sharding.is_equivalent_to(NamedSharding(mesh_dm, P("data", None)), 2)
    assert jitted.jax().sharding.is_equivalent_to(NamedSharding(mesh_dm, P("data", "model")), 2)
    assert_close(jitted, x + 1)


@pytest.mark.parametrize(
    ("spec", "mesh", "match"),
    [
        (("data", None), False, r"constrain\(\) needs a mesh: pass mesh="),
        ((None, ("model", "model")), True, r"(?s)constrain\(\) \(1 problem\).*mesh axis 'model' is used twice"),
        (("model", None, None), True, r"activation \(6, 4\) spec .*: spec has 3 entries but the tensor has rank 2"),
        (("data", None), True, r"activation \(6, 4\) .*: dim 0 \(size 6\) is not divisible by data \(size 4\)"),
        (("dta", None), True, r"unknown mesh axis 'dta'; use one of \['data', 'model'\]"),
        (("data", 3), True, r"constrain\(\): spec \('data', 3\) for activation \(6, 4\) on Mesh\(data=4, model=2\)"),
    ],
)
def test_constrain_errors(mesh_dm, spec, mesh, match):
    placed = wrap(put(torch.randn(6, 4), NamedSharding(mesh_dm, P())))
    with pytest.raises(ShardingError, match=match):
        torchshard.constrain(placed, spec, mesh_dm if mesh else None)


# --- init_sharded -------------------------------------------------------------------------------


class Deterministic(nn.Module):
    """Random inits overwritten by deterministic ones (ones/zeros, arange, fill_)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.proj = nn.Linear(32, 64)
        self.register_buffer("pos", torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 1000)
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.proj.weight.copy_(torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32).sin())
            self.proj.bias.fill_(0.25)


FSDP8_SHARDS = {  # data=8: each device holds 1/8 of every tensor of at least 16 elements
    "norm.weight": (P("data"), (8,)),
    "norm.bias": (P("data"), (8,)),
    "proj.weight": (P("data", None), (8, 32)),
    "proj.bias": (P("data"), (8,)),
    "pos": (P("data", None), (8, 32)),
    "scale": (P(), (4,)),
}


def test_init_sharded_shards_and_values(mesh_fsdp):
    torch.manual_seed(0)
    model = torchshard.init_sharded(Deterministic, mesh_fsdp, presets.fsdp(min_size=16))
    tensors = _tensors(model)
    assert set(tensors) == set(FSDP8_SHARDS)
    for name, (spec, shard_shape) in FSDP8_SHARDS.items():
        array = tensors[name].jax()
        assert array.sharding.spec == spec, name
        assert len(array.addressable_shards) == 8
        assert {s.data.shape for s in array.addressable_shards} == {shard_shape}, name
    torch.manual_seed(0)
    assert_trees_close(model.state_dict(), Deterministic().state_dict())


def test_init_sharded_random_init_is_seeded(mesh_dm):
    def build(seed):
        model = torchshard.init_sharded(lambda: MLP(), mesh_dm, presets.fsdp(min_size=16), seed=seed)
        return {name: to_numpy(t) for name, t in model.state_dict().items()}

    torch.manual_seed(5)
    default, five, six = build(None), build(5), build(6)  # the default seed is torch's
    assert_trees_close(default, five, tol=0)
    assert not np.allclose(five["layers.0.weight"], six["layers.0.weight"])
    weight = five["layers.1.weight"]  # torch's Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert np.abs(weight).max() <= 1 / np.sqrt(64) and weight.std() > 0.25 / np.sqrt(64)


def test_init_sharded_model_runs_like_torch(mesh_dm):
    model = torchshard.init_sharded(TiedLM, mesh_dm, PLANS["fsdp+tp"](TP["tiedlm"]), seed=3)
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.jax().sharding.spec == P("model", "data")
    reference = TiedLM()
    reference.load_state_dict({name: torch.from_numpy(np.asarray(t.jax())) for name, t in model.state_dict().items()})
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids)
    assert_close(_jit_forward(model)(_batch(ids, mesh_dm)), expected)


class WithIntegerBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(16)  # num_batches_tracked is int64 in torch
        self.register_buffer("index", torch.arange(16))


def test_init_sharded_narrows_64_bit_buffers_quietly(mesh_dm):
    # filterwarnings = error: JAX's "int64 is not available" warning would fail this test
    model = torchshard.init_sharded(WithIntegerBuffers, mesh_dm, presets.fsdp(min_size=16))
    assert model.index.jax().sharding.spec == P("data")
    assert_trees_close(model.state_dict(), WithIntegerBuffers().state_dict())


def test_init_sharded_reports_plan_errors(mesh_dm):
    with pytest.raises(ShardingError, match=r"layers\.0\.weight \(64, 32\) .*unknown mesh axis 'modle'"):
        torchshard.init_sharded(lambda: MLP(), mesh_dm, [(r"layers\.0\.weight", ("modle", None))])


def test_shard_batch_places_every_leaf_and_runs_the_model(mesh_dm):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(16, 32)
    expected = model(x)
    torchshard.shard(model, torchshard.plan(model, mesh_dm, presets.fsdp(min_size=64)))
    batch = torchshard.shard_batch({"x": x, "scale": torch.tensor(2.0)}, mesh_dm)
    assert batch["x"].jax().sharding == NamedSharding(mesh_dm, P("data"))
    assert batch["scale"].jax().sharding == NamedSharding(mesh_dm, P())
    with torchax.default_env():
        out = model(batch["x"]) * batch["scale"]
    assert_close(out, expected * 2, tol=1e-5, what="forward on a sharded batch")


@pytest.mark.parametrize(
    ("batch", "spec", "match"),
    [
        (torch.zeros(6, 4), ("data",), r"batch leaf #0 \(6, 4\).*dim 0 \(size 6\) is not divisible by data \(size 4\)"),
        ((torch.zeros(8, 4), torch.zeros(8, 3)), ("data", "model"), r"batch leaf #1 \(8, 3\).*dim 1 \(size 3\)"),
        (torch.zeros(8, 4), ("batch",), r"unknown mesh axis 'batch'; use one of \['data', 'model'\]"),
    ],
)
def test_shard_batch_errors(mesh_dm, batch, spec, match):
    with pytest.raises(ShardingError, match=match):
        torchshard.shard_batch(batch, mesh_dm, spec)
