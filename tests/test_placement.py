"""Placement: sharded forward equals eager torch; shardings follow the plan; constrain; sharded init."""

import copy
import re

import jax
import numpy as np
import pytest
import torch
import torchax
import torchax.interop
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard
from testsupport.helpers import Counter, assert_close, assert_trees_close, jit_forward, module_tensors
from testsupport.models import MLP, Block, TiedLM
from torchshard import ShardingError, presets
from torchshard._bridge.tensors import wrap
from torchshard._sharding.placement import put

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
    for name, tensor in module_tensors(model).items():
        assert tensor.jax().sharding.spec == plan.spec(name), name
        assert tensor.jax().sharding.mesh == mesh_dm
    forward = jit_forward(model) if mode == "jit" else _eager_forward(model)
    assert_close(forward(torchshard.shard_batch(x, mesh_dm)), expected, what=f"{model_name}/{plan_name}/{mode}")


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
    for name, tensor in module_tensors(model).items():
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


def test_shard_accepts_its_own_narrowed_int64_but_not_a_changed_dtype(mesh_dm):
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    plan = torchshard.plan(model, mesh_dm)
    torchshard.shard(torchshard.shard(model, plan), plan)  # placed int64 is held as int32: the same dtype
    with pytest.raises(ShardingError, match=r"0\.weight: model dtype torch\.bfloat16 but plan dtype torch\.float32"):
        torchshard.shard(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(torch.bfloat16), plan)


def test_shard_rejects_metamodule_tensors(mesh_dm):
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


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ("abc", r"batch leaf #0 is a str; pass torch tensors, numpy or jax arrays"),
        ([1, 2.0], r"(?s)\(2 problems\).*batch leaf #0 is a int.*batch leaf #1 is a float"),
        (torch.zeros(8, 4, device="meta"), r"batch leaf #0 \(8, 4\) is on the meta device \(no values\)"),
    ],
    ids=["str", "python_numbers", "meta"],
)
def test_shard_batch_rejects_what_is_not_an_array(mesh_dm, batch, match):
    with pytest.raises(torchshard.ArgumentError, match=r"invalid shard_batch\(\) arguments"):
        torchshard.shard_batch(batch, mesh_dm)
    with pytest.raises(torchshard.ArgumentError, match=match):
        torchshard.shard_batch(batch, mesh_dm)


def test_constrain_rejects_a_mesh_that_is_not_a_mesh(mesh_dm):
    with pytest.raises(torchshard.ArgumentError, match=r"mesh must be a jax Mesh, e\.g\. make_mesh.*got dict"):
        torchshard.constrain(torchshard.shard_batch(torch.ones(8, 4), mesh_dm), ("data",), mesh={"data": 8})


# --- 64-bit integers JAX holds in 32 bits --------------------------------------------------------

INT32_MAX = 2**31 - 1


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (torch.tensor([0, INT32_MAX]), None),
        (torch.tensor([-(2**31)]), None),
        (
            torch.tensor([INT32_MAX + 1]),
            r"x \(1,\) torch\.int64: values in \[2147483648, 2147483648\] do not fit int32",
        ),
        (torch.tensor([-(2**40), 3]), r"values in \[-1099511627776, 3\] do not fit int32"),
        (np.array([2**33], dtype=np.int64), r"x \(1,\) int64: values in \[8589934592, 8589934592\] do not fit int32"),
        (np.array([2**32], dtype=np.uint64), r"do not fit uint32.*keep the values within \[0, 4294967295\]"),
        (torch.tensor([2.0**40]), None),  # floats narrow with rounding, as torch users expect
        (torch.zeros(0, dtype=torch.int64), None),
        (torch.zeros(2, dtype=torch.int64, device="meta"), None),
    ],
)
def test_range_problems(value, problem):
    from torchshard._sharding.placement import range_problems

    found = range_problems("x", value)
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and re.search(problem, found[0]), found
        assert found[0].endswith("call jax.config.update('jax_enable_x64', True) first thing in the program")


def test_shard_refuses_an_int64_that_32_bits_cannot_hold_and_moves_nothing(mesh_dm):
    model = Counter()
    before = {n: t for n, t in module_tensors(model).items()}
    with pytest.raises(ShardingError, match=r"shard\(\): Counter holds values JAX cannot; nothing was moved") as info:
        torchshard.shard(model, torchshard.plan(model, mesh_dm))
    assert info.value.problems[0].startswith("count (2,) torch.int64: values in [1, 1099511627776] do not fit int32")
    assert all(module_tensors(model)[n] is t and t.device.type == "cpu" for n, t in before.items())


def test_from_torch_state_dict_refuses_an_int64_value_that_32_bits_cannot_hold(mesh_dm):
    model = Counter(count=5)
    state = {**model.state_dict(), "count": torch.tensor([-(2**35), 0])}
    before = {n: t for n, t in module_tensors(model).items()}
    with pytest.raises(ShardingError, match=r"state_dict values JAX cannot hold \(1 problem\):\n  - count \(2,\)"):
        torchshard.from_torch_state_dict(model, state, torchshard.plan(model, mesh_dm))
    assert all(module_tensors(model)[n] is t and t.device.type == "cpu" for n, t in before.items())


def test_from_torch_state_dict_takes_the_models_dtypes_like_load_state_dict(mesh_dm):
    model = MLP()
    state = {k: (v * 4).round().long() for k, v in MLP().state_dict().items()}  # integers into a float model
    torchshard.from_torch_state_dict(model, state, torchshard.plan(model, mesh_dm))
    reference = MLP()
    reference.load_state_dict(state)
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())
    assert_trees_close(model.state_dict(), reference.state_dict(), tol=0)
