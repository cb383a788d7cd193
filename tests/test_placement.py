"""Placement: sharded forward equals eager torch; shardings follow the plan; constrain; sharded init."""

import copy
import re

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
        torchshard.constrain(_batch(torch.ones(8, 4), mesh_dm), ("data",), mesh={"data": 8})


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
    from torchshard._placement import range_problems

    found = range_problems("x", value)
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and re.search(problem, found[0]), found
        assert found[0].endswith("call jax.config.update('jax_enable_x64', True) first thing in the program")


class Counter(nn.Module):
    """A module with an int64 buffer whose value needs 64 bits (a token count, say)."""

    def __init__(self, count: int = 2**40):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.tensor([count, 1]))


def test_shard_refuses_an_int64_that_32_bits_cannot_hold_and_moves_nothing(mesh_dm):
    model = Counter()
    before = {n: t for n, t in _tensors(model).items()}
    with pytest.raises(ShardingError, match=r"shard\(\): Counter holds values JAX cannot; nothing was moved") as info:
        torchshard.shard(model, torchshard.plan(model, mesh_dm))
    assert info.value.problems[0].startswith("count (2,) torch.int64: values in [1, 1099511627776] do not fit int32")
    assert all(_tensors(model)[n] is t and t.device.type == "cpu" for n, t in before.items())


def test_from_torch_state_dict_refuses_an_int64_value_that_32_bits_cannot_hold(mesh_dm):
    model = Counter(count=5)
    state = {**model.state_dict(), "count": torch.tensor([-(2**35), 0])}
    before = {n: t for n, t in _tensors(model).items()}
    with pytest.raises(ShardingError, match=r"state_dict values JAX cannot hold \(1 problem\):\n  - count \(2,\)"):
        torchshard.from_torch_state_dict(model, state, torchshard.plan(model, mesh_dm))
    assert all(_tensors(model)[n] is t and t.device.type == "cpu" for n, t in before.items())


def test_from_torch_state_dict_takes_the_models_dtypes_like_load_state_dict(mesh_dm):
    model = MLP()
    state = {k: (v * 4).round().long() for k, v in MLP().state_dict().items()}  # integers into a float model
    torchshard.from_torch_state_dict(model, state, torchshard.plan(model, mesh_dm))
    reference = MLP()
    reference.load_state_dict(state)
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())
    assert_trees_close(model.state_dict(), reference.state_dict(), tol=0)


# --- init_sharded's front door and failures ------------------------------------------------------


def _ldexp_init():
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.ldexp_(torch.ones(4, 4))  # no torchax lowering (nor of ldexp)
    return model


class _ShapesChange:
    """Builds Linear(4, 4) and Linear(8, 4) in turn, as a model_fn reading a changing global would."""

    calls = 0

    def __call__(self) -> nn.Module:
        self.calls += 1
        return nn.Linear(4 if self.calls % 2 else 8, 4)


@pytest.mark.parametrize(
    ("model_fn", "mesh", "kwargs", "error", "match"),
    [
        (lambda: None, "dm", {}, torchshard.ArgumentError, r"model_fn\(\) must be a torch\.nn\.Module .*got NoneType"),
        (lambda: (MLP(), 1), "dm", {}, torchshard.ArgumentError, r"model_fn\(\) must be a torch\.nn\.Module"),
        (MLP(), "dm", {}, torchshard.ArgumentError, r"model_fn is a built MLP; pass a function that builds it"),
        (lambda n: MLP(), "dm", {}, torchshard.ArgumentError, r"no arguments \(missing a required argument: 'n'\)"),
        (MLP, {"data": 8}, {}, torchshard.ArgumentError, r"mesh must be a jax Mesh of devices.*got dict"),
        (MLP, "abstract", {}, torchshard.ArgumentError, r"mesh must be a jax Mesh of devices.*got AbstractMesh"),
        (MLP, "dm", {"default": "x", "seed": -1}, torchshard.ArgumentError, r"(?s)\(2 problems\).*default='x'.*seed"),
        (MLP, "dm", {"rules": "fsdp"}, torchshard.ArgumentError, r"rules must be a list of \(pattern, spec\) pairs"),
        (
            lambda: 1 / 0,
            "dm",
            {},
            ShardingError,
            r"model_fn\(\) raised ZeroDivisionError while building .* on the meta",
        ),
        (
            lambda: nn.Linear(4, 4, device="cpu"),
            "dm",
            {},
            torchshard.ArgumentError,
            r"model_fn\(\) creates 2 tensor\(s\) on cpu itself \(weight, bias\); drop the device= arguments",
        ),
        (_ShapesChange(), "dm", {}, ShardingError, r"(?s)built a different model the second time.*mis-shaped weight"),
        (Counter, "dm", {}, ShardingError, r"creates a 64-bit integer that does not fit .* tensors: \['count'\]"),
        (_ldexp_init, "dm", {}, ShardingError, r"building under torchax.*aten::ldexp.Tensor has no lowering"),
    ],
    ids=[
        "returns_none",
        "returns_tuple",
        "module_instance",
        "needs_arguments",
        "dict_mesh",
        "abstract_mesh",
        "default_and_seed",
        "rules_string",
        "raises",
        "device_inside",
        "nondeterministic",
        "int64_overflow",
        "no_lowering",
    ],
)
def test_init_sharded_errors(mesh_dm, model_fn, mesh, kwargs, error, match):
    meshes = {"dm": mesh_dm, "abstract": mesh_dm.abstract_mesh}
    with pytest.raises(error, match=match):
        torchshard.init_sharded(model_fn, meshes[mesh] if isinstance(mesh, str) else mesh, **kwargs)


# --- init_sharded of models whose init calls torch.nn.init.normal_ (transformers' _init_weights) --------


@pytest.fixture
def normal_lowering():
    """torchax's env with torchshard._init_ops.normal_ for aten.normal_ (torchax's own fails on every call)."""
    from torchshard import _init_ops, _torchax

    tx = _torchax.env()
    previous = tx._ops.get(torch.ops.aten.normal_)
    tx.override_op_definition(torch.ops.aten.normal_, _init_ops.normal_)
    yield
    tx._ops[torch.ops.aten.normal_] = previous


class NormalInit(nn.Module):
    """Keyword-argument normal_ inits, as transformers writes them; std=0 ones are deterministic."""

    def __init__(self):
        super().__init__()
        self.fixed = nn.Linear(16, 64)
        self.random = nn.Linear(16, 64, bias=False)
        nn.init.normal_(self.fixed.weight, mean=5.0, std=0.0)
        nn.init.normal_(self.fixed.bias, mean=-1.0, std=0.0)
        nn.init.normal_(self.random.weight, mean=0.0, std=0.02)


def test_init_sharded_runs_keyword_normal_inits(mesh_fsdp, normal_lowering):
    model = torchshard.init_sharded(NormalInit, mesh_fsdp, presets.fsdp(min_size=64), seed=0)
    fixed = lambda m: {k: v for k, v in m.state_dict().items() if k.startswith("fixed")}  # noqa: E731
    assert_trees_close(fixed(model), fixed(NormalInit()), tol=0)
    weight = to_numpy(model.random.weight)
    assert 0.015 < weight.std() < 0.025 and abs(weight.mean()) < 0.005  # N(0, 0.02²), 1024 samples
    assert model.random.weight.jax().sharding.spec == P("data", None)


def tiny_llama_config():
    transformers = pytest.importorskip("transformers")
    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 32}
    return transformers.LlamaConfig(**sizes, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


def test_init_sharded_builds_an_hf_llama_from_its_config_sharded_from_birth(mesh_fsdp, normal_lowering):
    import transformers

    config = tiny_llama_config()
    model = torchshard.init_sharded(lambda: transformers.LlamaForCausalLM(config), mesh_fsdp, presets.fsdp(min_size=64))
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config)
    expected = _tensors(eager)
    for name, tensor in _tensors(model).items():
        array = tensor.jax()
        if "data" in str(array.sharding.spec):  # each device holds 1/8 of every FSDP-sharded tensor
            assert {s.data.size for s in array.addressable_shards} == {array.size // 8}, name
        if name.endswith(("inv_freq", "norm.weight", "layernorm.weight")):  # deterministic: equal eager torch
            assert_close(array, expected[name], tol=0, what=name)
        else:  # transformers' normal_(mean=0, std=initializer_range)
            values = to_numpy(array)
            assert 0.5 * config.initializer_range < values.std() < 1.5 * config.initializer_range, name
    eager.load_state_dict(torchshard.to_torch_state_dict(model))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = eager(input_ids=ids).logits
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    forward = torchax.interop.jax_jit(lambda p, x: torch.func.functional_call(model, p, (), {"input_ids": x}).logits)
    assert_close(forward(params, _batch(ids, mesh_fsdp)), logits, tol=1e-5, what="logits")


@pytest.fixture
def init_overrides(normal_lowering):
    """Also ``Tensor.is_meta`` False for torchax tensors (torch.nn.init returns early on meta tensors)."""
    from torchshard import _init_ops, _torchax

    tx, key = _torchax.env(), torch.Tensor.is_meta.__get__
    previous = tx._ops.get(key)
    tx.override_op_definition(key, _init_ops.is_meta)
    yield
    if previous is None:
        del tx._ops[key]
    else:
        tx._ops[key] = previous


class SparseDiracInit(nn.Module):
    """Inits that return early for meta tensors: sparse_ (half of each column zero) and a dirac_ kernel."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)
        self.conv = nn.Conv1d(8, 8, 3, bias=False)
        nn.init.sparse_(self.proj.weight, sparsity=0.5, std=0.02)
        nn.init.dirac_(self.conv.weight)


@pytest.mark.slow
def test_init_sharded_runs_inits_that_check_is_meta(mesh_fsdp, init_overrides):
    model = torchshard.init_sharded(SparseDiracInit, mesh_fsdp, presets.fsdp(min_size=64), seed=0)
    weight = to_numpy(model.proj.weight)
    assert ((weight == 0).sum(axis=0) == 32).all() and 0.01 < weight[weight != 0].std() < 0.03
    assert_close(model.conv.weight, SparseDiracInit().conv.weight, tol=0, what="dirac_ equals eager torch")
