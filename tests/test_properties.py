"""Property: for any rule table, spec and mesh, plan() returns a valid plan or raises ShardingError, and never
changes the model."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, PartitionSpec
from torch import nn

import torchshard
from testsupport.models import MLP, TiedLM
from torchshard import ShardingError, UnusedRuleWarning, presets
from torchshard._base.validate import spec_problems

AXES = ("data", "model", "expert", "seq")
ABSENT = ("nope", "Data", "")
SIZES = (16, 32, 8, 64, 24, 4, 12, 6, 2, 3, 1)  # hypothesis favours the first: dims most meshes divide


def factorisations(n: int) -> list[tuple[int, ...]]:
    """Every ordered way to write ``n`` as 1 to 3 factors ≥ 1."""
    out = [(n,)]
    out += [(a, n // a) for a in range(1, n + 1) if n % a == 0]
    out += [(a, b, n // (a * b)) for a in range(1, n + 1) for b in range(1, n + 1) if n % (a * b) == 0]
    return out


# axes of size > 1 first, for the same reason
meshes = st.sampled_from(sorted((f for n in (8, 16) for f in factorisations(n)), key=lambda f: 1 in f)).flatmap(
    lambda sizes: st.permutations(AXES).map(lambda names: AbstractMesh(sizes, tuple(names[: len(sizes)])))
)


class Mixed(nn.Module):
    """Embedding, LayerNorm, BatchNorm (an int64 buffer), a bias-free Linear and a non-persistent buffer."""

    def __init__(self, vocab: int, dim: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.bn = nn.BatchNorm1d(hidden)
        self.proj = nn.Linear(dim, hidden, bias=False)
        self.register_buffer("scratch", torch.zeros(hidden, 2), persistent=False)


size = st.sampled_from(SIZES)
models = st.one_of(
    st.tuples(size, size, size).map(lambda s: MLP(s)),
    st.tuples(size, size, size).map(lambda s: Mixed(*s)),
    st.just(None).map(lambda _: TiedLM()),
)


def spec_strategies(mesh: AbstractMesh) -> tuple[st.SearchStrategy[str], st.SearchStrategy[object]]:
    """Axis names (mostly the mesh's, some absent) and specs built from them in every form users write."""
    names = st.sampled_from(tuple(mesh.axis_names) * 4 + AXES + ABSENT)
    entries = st.one_of(st.none(), names, names, st.lists(names, min_size=1, max_size=2).map(tuple))
    specs = st.lists(entries, max_size=3).flatmap(
        lambda e: st.sampled_from([tuple(e), list(e), PartitionSpec(*e)] + ([e[0]] if e else [None]))
    )
    return names, specs


garbage_specs = st.sampled_from([3, {"data": 1}, ("data", 3), [["data", 1]], b"data", 1.5, object()])


def spec_function(returns):
    def spec(info):
        if returns == "raise":
            raise RuntimeError("a rule's callable failed")
        return returns

    return spec


def patterns_for(model: nn.Module) -> st.SearchStrategy[str]:
    names = [n for n, _ in model.state_dict().items()] or ["x"]
    return st.one_of(
        *[st.sampled_from(names).map(re.escape)] * 3,
        st.sampled_from(names).map(lambda n: n.rsplit(".", 1)[0] + r"\..*"),
        st.sampled_from([".*", r".*\.weight", r".*\.bias", "layers", "(", "[a-", "*", r"layers\.(\d+", ""]),
        st.text(alphabet="ab.*()[]|\\0w", max_size=6),
    )


def tables(model: nn.Module, mesh: AbstractMesh) -> st.SearchStrategy[Callable[[], object]]:
    """Ways a user writes ``rules=``, each built when called (building Rules or a preset may raise too)."""
    axis_names, specs = spec_strategies(mesh)
    callable_specs = st.one_of(specs.map(spec_function), st.sampled_from(["raise", 3, "model"]).map(spec_function))
    spec = st.one_of(*[specs] * 6, garbage_specs, callable_specs)
    rows = st.lists(st.tuples(patterns_for(model), spec), min_size=1, max_size=4)
    preset = st.one_of(
        *[st.tuples(axis_names, st.sampled_from([1, 16, 1024])).map(lambda a: lambda: presets.fsdp(*a))] * 2,
        st.tuples(st.lists(patterns_for(model), max_size=2), axis_names).map(
            lambda a: lambda: presets.tensor_parallel(colwise=a[0], axis=a[1])
        ),
        st.just(presets.replicated),
    )
    return st.one_of(
        rows.map(lambda r: lambda: r),
        rows.map(lambda r: lambda: dict(r)),
        rows.map(lambda r: lambda: torchshard.Rules(r)),
        *[st.tuples(rows, preset).map(lambda rp: lambda: torchshard.Rules(rp[0]) + rp[1]())] * 2,
        *[preset] * 2,
        st.sampled_from([None, "fsdp", 3, {("a", None)}]).map(lambda r: lambda: r),
    )


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return {n: (t, t.detach().clone(), t.requires_grad) for n, t in tensors.items()}


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (tensor, values, grad) in before.items():
        now = after[name][0]
        assert now is tensor and now.requires_grad == grad and torch.equal(now.detach(), values), name


def assert_valid(plan: torchshard.ShardingPlan, model: nn.Module, mesh: AbstractMesh) -> None:
    tensors = snapshot(model)
    assert set(plan) == set(tensors)
    for name, entry in plan.entries.items():
        assert entry.shape == tuple(tensors[name][0].shape) and entry.dtype == tensors[name][0].dtype, name
        assert spec_problems(name, entry.shape, entry.spec, mesh) == [], name
        assert entry.sharding.mesh == mesh and entry.sharding.spec == entry.spec, name
        assert len(entry.shard_shape) == len(entry.shape)
        if entry.tied_to is not None:
            assert plan.spec(entry.tied_to) == entry.spec, name


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), model=models, mesh=meshes, default=st.sampled_from(["replicate"] * 4 + ["error", "raise"]))
def test_plan_returns_a_valid_plan_or_raises_a_sharding_error_and_never_changes_the_model(data, model, mesh, default):
    rules = data.draw(tables(model, mesh), label="rules")
    before = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedRuleWarning)  # any other warning still fails the test
        try:
            plan = torchshard.plan(model, mesh, rules(), default=default)
        except ShardingError as error:
            assert str(error) and all(p for p in error.problems)
            event(f"raised {type(error).__name__}")
        else:
            assert_valid(plan, model, mesh)
            shards = plan.bytes_per_device() < plan.total_bytes()
            event("returned a valid plan that shards" if shards else "returned a valid plan, all replicated")
    assert_unchanged(model, before)


@pytest.mark.parametrize("rows", [[(".*", ("data", "data"))], [("(", None)], [(".*", lambda info: 1 / 0)]])
def test_the_property_sees_errors(rows):
    """The strategies reach the error paths the property is about (a guard against vacuous passes)."""
    with pytest.raises(ShardingError):
        torchshard.plan(MLP(), AbstractMesh((8,), ("data",)), rows)
