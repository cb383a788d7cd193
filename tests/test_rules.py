"""Rule tables: fullmatch, first match wins, concatenation, spec forms and module annotations."""

import pytest
import torch
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard
from testsupport.models import MLP
from torchshard import Rules, ShardingError


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        (r"fc\.weight", "fc.weight", True),
        (r"fc\.weight", "fc.weight2", False),  # fullmatch, not match
        (r"fc\.weight", "block.fc.weight", False),  # fullmatch, not search
        (r"weight", "fc.weight", False),
        (r".*weight", "fc.weight", True),
        (r"fc.weight", "fcXweight", True),  # an unescaped dot is any character
        (r"layers\.\d+\.weight", "layers.12.weight", True),
        (r"layers\.\d+\.weight", "layers.x.weight", False),
        (r"a|b", "a", True),
        (r"a|b", "ab", False),
    ],
)
def test_fullmatch_semantics(pattern, name, matches):
    assert (Rules([(pattern, ("data",))]).spec_for(name) is not None) is matches


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("layers.0.weight", P("model", None)),
        ("layers.1.weight", P(None, "model")),
        ("layers.0.bias", P("model")),
        ("layers.1.bias", P()),
        ("other", None),
    ],
)
def test_first_match_wins(name, expected):
    rules = Rules(
        [
            (r"layers\.0\.weight", ("model", None)),
            (r".*\.weight", (None, "model")),
            (r"layers\.0\..*", ("model",)),
            (r"layers\..*", None),
            (r".*\.weight", ("data", None)),  # never reached
        ]
    )
    assert rules.spec_for(name) == expected


def test_addition_concatenates_in_order():
    first = Rules([(r"a", ("data",))], source="first")
    second = Rules([(r"a|b", ("model",))], source="second")
    both = first + second
    assert len(both) == 2
    assert [r.pattern for r in both] == ["a", "a|b"]
    assert [r.source for r in both] == ["first", "second"]
    assert both.spec_for("a") == P("data")
    assert both.spec_for("b") == P("model")
    assert (second + first).spec_for("a") == P("model")


def test_addition_keeps_transforms_of_both():
    fsdp = torchshard.presets.fsdp()
    rules = Rules([(r"a", ())]) + fsdp + torchshard.presets.fsdp("model")
    assert [t.axis for t in rules.transforms] == ["data", "model"]
    assert len(rules) == 1


def test_addition_with_a_list_is_a_type_error():
    with pytest.raises(TypeError):
        Rules() + [(r"a", ())]  # noqa: RUF005


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (P("data", None), P("data", None)),
        (P(("data", "model")), P(("data", "model"))),
        (("data", None), P("data", None)),
        ((None, "model"), P(None, "model")),
        ((("data", "model"), None), P(("data", "model"), None)),
        ([["data", "model"], None], P(("data", "model"), None)),
        (["data"], P("data")),
        ("data", P("data")),
        ((), P()),
        (None, P()),
    ],
)
def test_spec_forms(spec, expected):
    assert Rules([(r"w", spec)]).spec_for("w") == expected


def test_callable_spec_is_resolved_with_tensor_info(mesh_dm):
    def by_rank(info):
        return P(*(["data"] + [None] * (len(info.shape) - 1)))

    rules = Rules([(r".*", by_rank)])
    assert rules.spec_for("w") is by_rank
    info = torchshard.TensorInfo("w", (8, 4, 2), torch.float32, nn.Linear, mesh_dm)
    assert rules.spec_for("w", info) == P("data", None, None)


def test_spec_for_unmatched_is_none():
    assert Rules().spec_for("anything") is None
    assert Rules([(r"a", ())]).spec_for("b") is None


def test_bad_rows_are_all_reported_at_once():
    rows = [
        (r"ok\.weight", ("data", None)),
        (r"layers\.(\d+", ("data",)),
        (r"fc\.weight", ("data", 3)),
        (r"fc\.bias", {"data": 1}),
        "not a pair",
        (r".*", ("data",), "extra"),
    ]
    with pytest.raises(ShardingError, match=r"invalid rule table \(5 problem") as err:
        Rules(rows)
    message = str(err.value)
    assert len(err.value.problems) == 5
    assert r"rule #1 pattern 'layers\\.(\\d+' is not a valid regex" in message
    assert "rule #2 ('fc\\\\.weight') spec ('data', 3) is not a PartitionSpec" in message
    assert "rule #3 ('fc\\\\.bias') spec {'data': 1}" in message
    assert "rule #4 'not a pair' is not a (pattern, spec) pair" in message
    assert "rule #5" in message
    assert "rule #0" not in message


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ((r"(", ()), r"rule #0 pattern '\(' is not a valid regex .*escape dots and brackets"),
        ((r"w", ("data", 3)), r"rule #0 \('w'\) spec \('data', 3\) is not a PartitionSpec.*write e\.g\."),
        ((r"w", (("data", 1),)), r"rule #0 \('w'\) spec"),
        ((3, ()), r"rule #0 \(3, \(\)\) is not a \(pattern, spec\) pair"),
    ],
)
def test_bad_row(row, match):
    with pytest.raises(ShardingError, match=match):
        Rules([row])


def test_repr_lists_rows():
    text = repr(Rules([(r"fc\.weight", ("data", None))]) + torchshard.presets.fsdp())
    assert text == "Rules([\n  'fc\\\\.weight' → P('data', None),\n], transforms=[\"+fsdp('data')\"])"


# --- module annotations -------------------------------------------------------------------------


class Attention(nn.Module):
    shard_rules = [(r"qkv\.weight", ("model", None)), (r"out\.weight", (None, "model"))]

    def __init__(self, dim=16):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)


class Layer(nn.Module):
    shard_rules = [(r"norm\..*", ("data",)), (r".*\.weight", ("data", None))]

    def __init__(self, dim=16):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.mlp = nn.Linear(dim, dim)


class Net(nn.Module):
    def __init__(self, dim=16, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim) for _ in range(depth))
        self.qkv = nn.Linear(dim, dim)  # same leaf name as Attention.qkv, but no annotation applies to it


ANNOTATED = [
    ("layers.0.attn.qkv.weight", P("model", None)),  # deeper (Attention) wins over Layer's `.*\.weight`
    ("layers.1.attn.out.weight", P(None, "model")),
    ("layers.0.attn.qkv.bias", P()),
    ("layers.1.mlp.weight", P("data", None)),  # Layer's rule, relative to "layers.1."
    ("layers.1.norm.weight", P("data")),
    ("layers.0.mlp.bias", P()),
    ("qkv.weight", P()),  # patterns are relative to the annotated module, so the root's qkv is untouched
    ("qkv.bias", P()),
]


@pytest.mark.parametrize(("name", "expected"), ANNOTATED)
def test_module_annotations(mesh_dm, name, expected):
    with torch.device("meta"):
        net = Net()
    plan = torchshard.plan(net, mesh_dm)
    assert plan.spec(name) == expected


def test_annotation_rules_are_prefixed_and_deepest_first():
    rules = torchshard._sharding.rules.annotation_rules(Net(depth=1))
    assert [r.pattern for r in rules] == [
        r"layers\.0\.attn\.(?:qkv\.weight)",
        r"layers\.0\.attn\.(?:out\.weight)",
        r"layers\.0\.(?:norm\..*)",
        r"layers\.0\.(?:.*\.weight)",
    ]
    assert {r.source for r in rules} == {"Attention.shard_rules", "Layer.shard_rules"}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("layers.0.attn.qkv.weight", P(None, "model")),  # explicit beats the deeper annotation
        ("layers.1.attn.qkv.weight", P("model", None)),  # annotation where the explicit rule does not match
        ("layers.1.mlp.weight", P("data", None)),
    ],
)
def test_explicit_rules_win_over_annotations(mesh_dm, name, expected):
    plan = torchshard.plan(Net(), mesh_dm, [(r"layers\.0\.attn\.qkv\.weight", (None, "model"))])
    assert plan.spec(name) == expected


def test_annotation_on_the_root_module(mesh_dm):
    class Root(MLP):
        shard_rules = [(r"layers\.0\.weight", ("model", None))]

    plan = torchshard.plan(Root(), mesh_dm)
    assert plan.spec("layers.0.weight") == P("model", None)
    assert plan.spec("layers.1.weight") == P()
    assert "Root.shard_rules" in plan.entries["layers.0.weight"].rule


def test_bad_annotation_is_a_sharding_error(mesh_dm):
    class Bad(nn.Module):
        shard_rules = [(r"w(", ())]

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))

    with pytest.raises(ShardingError, match=r"rule #0 pattern 'w\(' is not a valid regex"):
        torchshard.plan(Bad(), mesh_dm)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Rules("fsdp"), r"rules must be a list of \(pattern, spec\) pairs .*got str 'fsdp'"),
        (lambda: Rules(5), r"rules must be a list .*got int 5"),
        (
            lambda: Rules({(r"a", ())}),
            r"rules is a set of 1 rows, which has no order, but the first matching rule wins",
        ),
        (lambda: Rules([], transforms=5), r"transforms=5 must be a list of SpecTransform \(e\.g\. presets\.fsdp\(\)\)"),
        (
            lambda: Rules([], transforms=["fsdp"], source=3),
            r"(?s)\(2 problems\).*source=3 must be a str.*transforms\[0\] is a str, not a SpecTransform",
        ),
        (
            lambda: Rules() + [(r"a", ())],  # noqa: RUF005
            r"Rules can only be added to Rules, got list .*; wrap it: Rules\(\[\.\.\.\]\)",
        ),
        (lambda: [(r"a", ())] + Rules(), r"Rules can only be added to Rules, got list"),  # noqa: RUF005
    ],
    ids=["string", "int", "set", "transforms_int", "transforms_and_source", "plus_list", "list_plus"],
)
def test_bad_rules_arguments_are_argument_errors(make, match):
    with pytest.raises(torchshard.ArgumentError, match=match):
        make()


def test_a_regex_python_warns_about_is_judged_by_its_error_alone():
    """'[[' makes re warn of a possible nested set (an error under -W error) before failing to compile."""
    with pytest.raises(ShardingError, match=r"rule #0 pattern '\[\[' is not a valid regex"):
        torchshard.Rules([("[[", ())])
