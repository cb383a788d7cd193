"""init_sharded: built directly sharded (never whole on one device), seeded, and every bad argument named."""

import numpy as np
import pytest
import torch
import torchax
import torchax.interop
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard
from testsupport.helpers import Counter, assert_close, assert_trees_close, jit_forward, module_tensors, to_numpy
from testsupport.models import MLP, TiedLM
from torchshard import ShardingError, presets

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
    tensors = module_tensors(model)
    assert set(tensors) == set(FSDP8_SHARDS)
    for name, (spec, shard_shape) in FSDP8_SHARDS.items():
        array = tensors[name].jax()
        assert array.sharding.spec == spec, name
        assert len(array.addressable_shards) == 8
        assert {s.data.shape for s in array.addressable_shards} == {shard_shape}, name
    torch.manual_seed(0)
    assert_trees_close(model.state_dict(), Deterministic().state_dict())


@pytest.mark.slow
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
    rules = presets.tensor_parallel(colwise=[r"block\.up"], rowwise=[r"block\.down", "embed"])
    model = torchshard.init_sharded(TiedLM, mesh_dm, rules + presets.fsdp(min_size=16), seed=3)
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.jax().sharding.spec == P("model", "data")
    reference = TiedLM()
    reference.load_state_dict({name: torch.from_numpy(np.asarray(t.jax())) for name, t in model.state_dict().items()})
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids)
    assert_close(jit_forward(model)(torchshard.shard_batch(ids, mesh_dm)), expected)


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
    """torchax's env with torchshard's aten.normal_ (torchax's own fails on every call), installed by env()."""
    from torchshard._bridge.env import env

    env()


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


@pytest.mark.slow
def test_init_sharded_builds_an_hf_llama_from_its_config_sharded_from_birth(mesh_fsdp, normal_lowering):
    import transformers

    config = tiny_llama_config()
    model = torchshard.init_sharded(lambda: transformers.LlamaForCausalLM(config), mesh_fsdp, presets.fsdp(min_size=64))
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config)
    expected = module_tensors(eager)
    for name, tensor in module_tensors(model).items():
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
    assert_close(forward(params, torchshard.shard_batch(ids, mesh_fsdp)), logits, tol=1e-5, what="logits")


@pytest.fixture
def init_overrides(normal_lowering):
    """Also ``Tensor.is_meta`` False for torchax tensors (torch.nn.init returns early on meta tensors)."""
    from torchshard._bridge.env import tensors_not_meta

    with tensors_not_meta():
        yield


class SparseDiracInit(nn.Module):
    """Inits that return early for meta tensors: sparse_ (half of each column zero) and a dirac_ kernel."""

    def __init__(self):
        super().__init__()
        # [64, 8]: sparse_ loops over the columns (a randperm and a scatter each), so XLA's compile time grows with
        # them; 8 columns of 64 rows check the same zeros per column and spread as 64 did
        self.proj = nn.Linear(8, 64, bias=False)
        self.conv = nn.Conv1d(8, 8, 3, bias=False)
        nn.init.sparse_(self.proj.weight, sparsity=0.5, std=0.02)
        nn.init.dirac_(self.conv.weight)


@pytest.mark.slow
def test_init_sharded_runs_inits_that_check_is_meta(mesh_fsdp, init_overrides):
    model = torchshard.init_sharded(SparseDiracInit, mesh_fsdp, presets.fsdp(min_size=64), seed=0)
    weight = to_numpy(model.proj.weight)
    assert ((weight == 0).sum(axis=0) == 32).all() and 0.01 < weight[weight != 0].std() < 0.03
    assert_close(model.conv.weight, SparseDiracInit().conv.weight, tol=0, what="dirac_ equals eager torch")
