"""ShardingPlan: every parameter and buffer resolved, rendered, and validated all at once."""

import json

import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard
from testsupport.models import MLP, TiedLM
from torchshard import ShardingError, UnusedRuleWarning, presets


def _norm_net():
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64))


class WithMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("mask", torch.ones(8, 8), persistent=False)


def test_plan_covers_params_and_buffers(mesh_dm):
    model = _norm_net()
    plan = torchshard.plan(model, mesh_dm)
    assert list(plan) == list(model.state_dict())
    kinds = {name: entry.kind for name, entry in plan.entries.items()}
    assert kinds == {
        "0.weight": "param",
        "0.bias": "param",
        "1.weight": "param",
        "1.bias": "param",
        "1.running_mean": "buffer",
        "1.running_var": "buffer",
        "1.num_batches_tracked": "buffer",
    }
    assert plan.entries["1.num_batches_tracked"].dtype == torch.int64


def test_plan_covers_non_persistent_buffers(mesh_dm):
    plan = torchshard.plan(WithMask(), mesh_dm, [(r"mask", ("data", None))])
    assert plan.spec("mask") == P("data", None)
    assert plan.entries["mask"].kind == "buffer"


@pytest.mark.parametrize(
    ("model_fn", "rules"),
    [
        (
            TiedLM,
            presets.tensor_parallel(colwise=[r"block\.up"], rowwise=[r"block\.down", "embed"])
            + presets.fsdp(min_size=16),
        ),
        (lambda: MLP((32, 64, 64, 16)), presets.fsdp(min_size=16)),
        (_norm_net, [(r"0\.weight", ("model", "data"))]),
    ],
    ids=["tiedlm-fsdp-tp", "mlp-fsdp", "norm-net"],
)
def test_plan_on_meta_equals_plan_on_cpu(mesh_dm, model_fn, rules):
    with torch.device("meta"):
        meta = model_fn()
    assert all(t.is_meta for t in meta.state_dict().values())
    on_meta, on_cpu = torchshard.plan(meta, mesh_dm, rules), torchshard.plan(model_fn(), mesh_dm, rules)
    assert dict(on_meta) == dict(on_cpu)
    assert on_meta.entries == on_cpu.entries


def test_plan_is_a_read_only_mapping(mesh_dm):
    plan = torchshard.plan(_norm_net(), mesh_dm, presets.fsdp(min_size=64))
    assert plan.mesh is mesh_dm
    assert len(plan) == 7
    assert plan["0.weight"] == NamedSharding(mesh_dm, P("data", None))
    assert plan.spec("0.weight") == P("data", None)
    assert "nope" not in plan
    with pytest.raises(KeyError):
        plan["nope"]
    with pytest.raises(TypeError):
        plan["0.weight"] = NamedSharding(mesh_dm, P())
    entry = plan.entries["0.weight"]
    assert (entry.shape, entry.shard_shape, entry.bytes_per_device, entry.total_bytes) == (
        (64, 32),
        (16, 32),
        2048,
        8192,
    )


def test_table(mesh_dm):
    plan = torchshard.plan(_norm_net(), mesh_dm, presets.fsdp(min_size=64))
    lines = plan.table().splitlines()
    assert str(plan) == plan.table()
    assert lines[0].split() == ["name", "shape", "dtype", "spec", "rule", "shard/device", "bytes/device"]
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert list(rows) == list(plan)
    expected = {
        "0.weight": ["64×32", "float32", "P('data', None)", "default: replicate +fsdp('data')", "16×32", "2.00 KiB"],
        "0.bias": ["64", "float32", "P('data',)", "default: replicate +fsdp('data')", "16", "64 B"],
        "1.num_batches_tracked": ["()", "int64", "P()", "default: replicate", "()", "8 B"],
    }
    for name, cells in expected.items():
        assert [c.strip() for c in rows[name].split("  ") if c.strip()] == [name, *cells]
    assert lines[-1] == "Mesh(data=4, model=2): 7 tensors, 9.26 KiB in all, 2.32 KiB per device (25.1% of the model)"


def test_table_shows_ties_and_rules(mesh_dm):
    plan = torchshard.plan(TiedLM(), mesh_dm, [(r"head\.weight", ("model", None))])
    rows = {line.split()[0]: line for line in plan.table().splitlines()[2:-1]}
    assert "'head\\\\.weight' → P('model', None)" in rows["embed.weight"]
    assert "tied to embed.weight" in rows["head.weight"]
    assert rows["head.weight"].endswith("0 B")  # counted once, under embed.weight
    assert plan.table().splitlines()[-1].startswith("Mesh(data=4, model=2): 10 tensors")


def test_bytes_per_device(mesh_dm):
    plan = torchshard.plan(_norm_net(), mesh_dm, presets.fsdp(min_size=64))
    # 0.weight 16×32 floats; 0.bias, 1.weight, 1.bias, running stats 16 floats each; num_batches_tracked 8 bytes
    assert plan.bytes_per_device() == 16 * 32 * 4 + 5 * 16 * 4 + 8
    assert plan.bytes_per_device("param") == 16 * 32 * 4 + 3 * 16 * 4
    assert plan.bytes_per_device("buffer") == 2 * 16 * 4 + 8
    assert plan.total_bytes() == 64 * 32 * 4 + 5 * 64 * 4 + 8
    replicated = torchshard.plan(_norm_net(), mesh_dm)
    assert replicated.bytes_per_device() == replicated.total_bytes() == plan.total_bytes()


def test_rows_are_json(mesh_dm):
    rows = json.loads(json.dumps(torchshard.plan(TiedLM(), mesh_dm).rows()))
    head = next(r for r in rows if r["name"] == "head.weight")
    assert head == {
        "name": "head.weight",
        "kind": "param",
        "shape": [64, 32],
        "dtype": "float32",
        "spec": "P()",
        "rule": "default: replicate",
        "shard_shape": [64, 32],
        "bytes_per_device": 0,
        "tied_to": "embed.weight",
    }


def test_diff(mesh_dm):
    fsdp = torchshard.plan(_norm_net(), mesh_dm, presets.fsdp(min_size=1000))
    replicated = torchshard.plan(_norm_net(), mesh_dm)
    assert fsdp.diff(replicated) == {"0.weight": (P("data", None), P())}
    assert fsdp.diff(fsdp) == {}


def test_plan_on_an_abstract_mesh(mesh_dm):
    plan = torchshard.plan(_norm_net(), mesh_dm.abstract_mesh, presets.fsdp(min_size=64))
    assert plan.entries["0.weight"].shard_shape == (16, 32)
    assert (
        plan.bytes_per_device() == torchshard.plan(_norm_net(), mesh_dm, presets.fsdp(min_size=64)).bytes_per_device()
    )


# --- ties -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rules", "spec", "rule"),
    [
        ([(r"head\.weight", ("model", None))], P("model", None), r"'head\\.weight'"),  # explicit alias beats default
        ([(r"embed\.weight", (None, "model"))], P(None, "model"), r"'embed\\.weight'"),
        ([(r"(embed|head)\.weight", ("model", None))], P("model", None), r"'(embed|head)\\.weight'"),
        ([], P(), "default: replicate"),
        # the same sharding spelled two ways is no conflict
        ([(r"embed\.weight", ("model",)), (r"head\.weight", (("model",), None))], P("model"), r"'embed\\.weight'"),
    ],
)
def test_tied_tensor_gets_one_sharding(mesh_dm, rules, spec, rule):
    plan = torchshard.plan(TiedLM(), mesh_dm, rules)
    assert plan.spec("embed.weight") == plan.spec("head.weight") == spec
    assert plan["embed.weight"] == plan["head.weight"]
    assert plan.entries["head.weight"].tied_to == "embed.weight"
    assert plan.entries["embed.weight"].tied_to is None
    assert plan.canonical("head.weight") == plan.canonical("embed.weight") == "embed.weight"
    assert rule in plan.entries["embed.weight"].rule
    assert [e.name for e in plan.unique_entries()].count("head.weight") == 0


# --- errors -----------------------------------------------------------------------------------------


def _mlp10():
    return MLP((32, 64, 64, 10))  # layers.2 is [10, 64]: 10 is not divisible by 4


WHERE = r"on Mesh\(data=4, model=2\)"
ERRORS = [
    (
        "unknown-axis",
        _mlp10,
        [(r"layers\.0\.weight", ("modle", None))],
        {},
        rf"layers\.0\.weight \(64, 32\) spec P\('modle', None\) {WHERE}: unknown mesh axis 'modle'; "
        r"use one of \['data', 'model'\]",
    ),
    (
        "unknown-axis-in-tuple",
        _mlp10,
        [(r"layers\.0\.bias", (("data", "modle"),))],
        {},
        r"layers\.0\.bias \(64,\) spec .*: unknown mesh axis 'modle'",
    ),
    (
        "rank",
        _mlp10,
        [(r"layers\.0\.bias", ("data", None))],
        {},
        rf"layers\.0\.bias \(64,\) spec P\('data', None\) {WHERE}: spec has 2 entries but the tensor has rank 1; "
        r"give at most 1",
    ),
    (
        "not-divisible",
        _mlp10,
        [(r"layers\.2\.weight", ("data", None))],
        {},
        rf"layers\.2\.weight \(10, 64\) spec P\('data', None\) {WHERE}: dim 0 \(size 10\) is not divisible by "
        r"data \(size 4\); pad the dim to a multiple of 4, shard another dim, or replicate it",
    ),
    (
        "not-divisible-two-axes",
        _mlp10,
        [(r"layers\.2\.bias", (("data", "model"),))],
        {},
        r"layers\.2\.bias \(10,\) .*: dim 0 \(size 10\) is not divisible by data × model \(size 8\)",
    ),
    (
        "axis-twice",
        _mlp10,
        [(r"layers\.1\.weight", ("data", "data"))],
        {},
        rf"layers\.1\.weight \(64, 64\) spec P\('data', 'data'\) {WHERE}: mesh axis 'data' is used twice; "
        r"each axis may shard one dim only",
    ),
    (
        "axis-twice-in-one-entry",
        _mlp10,
        [(r"layers\.1\.weight", (("model", "model"), None))],
        {},
        r"layers\.1\.weight \(64, 64\) .*: mesh axis 'model' is used twice",
    ),
    (
        "unmatched",
        _mlp10,
        [(r"layers\.[01]\..*", ())],
        {"default": "error"},
        rf"layers\.2\.weight \(10, 64\) {WHERE}: no rule matches and default='error'; add a rule for it "
        r"\(e\.g\. \('layers\.2\.weight', \(\)\)\) or use default='replicate'",
    ),
    (
        "tied-conflict",
        TiedLM,
        [(r"embed\.weight", ("model", None)), (r"head\.weight", (None, "model"))],
        {},
        rf"tied tensor embed\.weight = head\.weight {WHERE} gets conflicting specs: embed\.weight → "
        r"P\('model', None\) .*, head\.weight → P\(None, 'model'\) .*; a tied tensor has one sharding",
    ),
    (
        "bad-default",
        _mlp10,
        [],
        {"default": "raise"},
        r"(?s)invalid plan\(\) arguments.*default='raise' must be 'replicate' or 'error'",
    ),
    (
        "bad-rules",
        _mlp10,
        [(r"layers\.(", ())],
        {},
        r"(?s)invalid rule table \(1 problem\).*rule #0 pattern 'layers\\\\\.\('",
    ),
    (
        "callable-spec-returns-no-spec",
        _mlp10,
        [(r"layers\.0\.weight", lambda info: 3)],
        {},
        r"layers\.0\.weight \(64, 32\): rule 'layers\\\\\.0\\\\\.weight' → <function .*> returned 3, not a "
        r"PartitionSpec .*; write e\.g\. \('data', None\)",
    ),
    (
        "callable-spec-raises",
        _mlp10,
        [(r".*\.bias", lambda info: info.shape[3])],
        {},
        r"layers\.0\.bias \(64,\): rule .* raised IndexError: tuple index out of range; fix the callable spec",
    ),
    (
        "rules-as-a-set",
        _mlp10,
        {(r".*", ())},
        {},
        r"rules is a set of 1 rows, which has no order, but the first matching rule wins; pass a list",
    ),
]


@pytest.mark.parametrize(("model_fn", "rules", "kwargs", "match"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_plan_errors(mesh_dm, model_fn, rules, kwargs, match):
    with pytest.raises(ShardingError, match=match):
        torchshard.plan(model_fn(), mesh_dm, rules, **kwargs)


def test_every_problem_is_reported_at_once(mesh_dm):
    rules = [
        (r"layers\.0\.weight", ("modle", None)),  # unknown axis
        (r"layers\.1\.bias", ("data", None)),  # longer than the rank
        (r"layers\.2\.weight", ("data", None)),  # 10 is not divisible by 4
    ]
    with pytest.raises(ShardingError, match=rf"invalid sharding plan for MLP {WHERE} \(3 problems\)") as err:
        torchshard.plan(_mlp10(), mesh_dm, rules)
    assert [p.split(" ")[0] for p in err.value.problems] == ["layers.0.weight", "layers.1.bias", "layers.2.weight"]
    message = str(err.value)
    for part in ("unknown mesh axis 'modle'", "rank 1", "dim 0 (size 10) is not divisible by data (size 4)"):
        assert part in message


def test_unmatched_names_are_listed_with_other_problems(mesh_dm):
    with pytest.raises(ShardingError, match=r"\(6 problems\)") as err:
        torchshard.plan(_mlp10(), mesh_dm, [(r"layers\.2\.weight", ("data", None))], default="error")
    assert sum("no rule matches" in p for p in err.value.problems) == 5


def test_unused_rule_warns_with_the_closest_names(mesh_dm):
    with pytest.warns(
        UnusedRuleWarning, match=r"rule 'layer\\\\\.0\\\\\.weight' → P\('model', None\) matched no tensor"
    ) as got:
        plan = torchshard.plan(_mlp10(), mesh_dm, [(r"layer\.0\.weight", ("model", None)), (r".*\.bias", ())])
    assert len(got) == 1
    assert "closest names: ['layers.0.weight'" in str(got[0].message)
    assert got[0].filename == __file__
    assert plan.spec("layers.0.weight") == P()


def test_no_warning_when_every_rule_matches(mesh_dm):
    torchshard.plan(_mlp10(), mesh_dm, [(r".*\.weight", (None, "model")), (r".*", ())])  # filterwarnings = error


@pytest.mark.parametrize(
    ("model", "mesh", "match"),
    [
        (lambda: _mlp10().state_dict(), "dm", r"model must be a torch\.nn\.Module \(not its state_dict\), got Ordered"),
        (_mlp10, {"data": 8}, r"mesh must be a jax Mesh, e\.g\. make_mesh\(\{'data': 8\}\), got dict"),
        (lambda: MLP, "dm", r"model must be a torch\.nn\.Module .*got type"),
    ],
    ids=["state_dict", "dict_mesh", "module_class"],
)
def test_plan_argument_errors(mesh_dm, model, mesh, match):
    with pytest.raises(torchshard.ArgumentError, match=match):
        torchshard.plan(model(), mesh_dm if mesh == "dm" else mesh)


def test_a_failed_plan_leaves_the_model_as_it_was(mesh_dm):
    model = TiedLM()
    before = {n: (t, t.clone()) for n, t in model.state_dict(keep_vars=True).items()}
    with pytest.raises(ShardingError):
        torchshard.plan(model, mesh_dm, [(r"embed\.weight", ("data", "data")), (r"pos", lambda info: 1 / 0)])
    after = model.state_dict(keep_vars=True)
    assert all(after[n] is t and torch.equal(t, copy) and t.device.type == "cpu" for n, (t, copy) in before.items())
