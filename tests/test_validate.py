"""The validation vocabulary: spec problems, name/shape mismatches and argument checks, message by message."""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from torchshard import ArgumentError, ShardingError
from torchshard._base.errors import raise_if_any
from torchshard._base.specs import as_rule_spec, as_spec, entry_axes, parse_spec
from torchshard._base.validate import (
    describe_mesh,
    instance_problems,
    int_problems,
    mismatch_problems,
    raise_for_arguments,
    spec_problems,
)

MESH = AbstractMesh((4, 2), ("data", "model"))
WHERE = "w (8, 6) spec {} on Mesh(data=4, model=2)"


@pytest.mark.parametrize(
    ("shape", "spec", "factors", "expected"),
    [
        ((8, 6), P("data", "model"), None, []),
        ((8, 6), P(None, None, None), None, [WHERE + ": spec has 3 entries but the tensor has rank 2; give at most 2"]),
        ((8, 6), P("expert"), None, [WHERE + ": unknown mesh axis 'expert'; use one of ['data', 'model']"]),
        (
            (8, 6),
            P("data", "data"),
            None,
            [
                WHERE + ": mesh axis 'data' is used twice; each axis may shard one dim only",
                WHERE + ": dim 1 (size 6) is not divisible by data (size 4); pad the dim to a multiple of 4, shard "
                "another dim, or replicate it",
            ],
        ),
        (
            (8, 6),
            P(("model", "model")),
            None,
            [WHERE + ": mesh axis 'model' is used twice; each axis may shard one dim only"],
        ),
        (
            (8, 6),
            P(None, ("data", "model")),
            None,
            [
                WHERE + ": dim 1 (size 6) is not divisible by data × model (size 8); pad the dim to a multiple of 8, "
                "shard another dim, or replicate it"
            ],
        ),
        (
            (8, 6),
            P("data"),
            {0: ("grad_accum_steps", 4)},
            [
                WHERE + ": dim 0 (size 8) is not divisible by data (size 4) × grad_accum_steps 4; pad the dim to a "
                "multiple of 16, shard another dim, or replicate it"
            ],
        ),
        (
            (8, 6),
            P(),
            {0: ("grad_accum_steps", 3)},
            [WHERE + ": dim 0 (size 8) is not divisible by grad_accum_steps 3; pad the dim to a multiple of 3, shard "
             "another dim, or replicate it"],
        ),
    ],
    ids=["fits", "rank", "unknown-axis", "axis-twice", "axis-twice-in-entry", "indivisible", "factor", "factor-only"],
)  # fmt: skip
def test_spec_problems(shape, spec, factors, expected):
    assert spec_problems("w", shape, spec, MESH, factors=factors) == [e.format(spec) for e in expected]


def test_spec_problems_custom_fix():
    (problem,) = spec_problems("x", (6,), P("data"), MESH, fix=lambda n: f"use a batch size that is a multiple of {n}")
    assert problem.endswith("; use a batch size that is a multiple of 4")


def test_mismatch_problems_report_every_name():
    got = mismatch_problems(
        {"a": (2,), "b": (3,)}, {"b": (4,), "c": ()}, expected_in="model", found_in="checkpoint", what="tensor "
    )
    assert got == [
        "missing tensor a (2,): in the model, not in the checkpoint",
        "unexpected tensor c (): in the checkpoint, not in the model",
        "mis-shaped tensor b: checkpoint (4,), model (3,)",
    ]


@pytest.mark.parametrize(
    ("value", "none", "expected"),
    [
        (1, None, []),
        (0, None, ["n=0 must be an int ≥ 1"]),
        (True, None, ["n=True must be an int ≥ 1"]),  # bool is no int here, everywhere
        (1.0, None, ["n=1.0 must be an int ≥ 1"]),
        (None, None, ["n=None must be an int ≥ 1"]),
        (None, "keep all", []),
        ("2", "keep all", ["n='2' must be an int ≥ 1 or None (keep all)"]),
    ],
)
def test_int_problems(value, none, expected):
    assert int_problems("n", value, minimum=1, none=none) == expected


def test_instance_problems_name_the_type():
    assert instance_problems("plan", [], dict, "a dict") == ["plan must be a dict, got list"]
    assert instance_problems("plan", {}, dict, "a dict") == []


def test_argument_error_is_a_type_error_and_a_sharding_error():
    with pytest.raises(TypeError, match=r"(?s)bad call \(2 problems\):\n  - a\n  - b") as caught:
        raise_for_arguments(["a", "b"], header="bad call")
    assert isinstance(caught.value, ShardingError) and isinstance(caught.value, ArgumentError)
    assert caught.value.problems == ("a", "b")
    raise_for_arguments([], header="nothing wrong")


def test_raise_if_any_uses_the_given_error_class():
    with pytest.raises(ArgumentError, match=r"head \(1 problem\)"):
        raise_if_any(["x"], header="head", error=ArgumentError)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, P()),
        ("data", P("data")),
        (("data", None), P("data", None)),
        (["data", ["data", "model"]], P("data", ("data", "model"))),
        (P("model"), P("model")),
        (("data", 3), None),
        (3, None),
        (lambda info: P(), None),
    ],
)
def test_parse_spec(spec, expected):
    assert parse_spec(spec) == expected


def test_concrete_and_rule_specs():
    fn = lambda info: P()  # noqa: E731
    assert as_rule_spec(fn) is fn
    assert as_rule_spec(("data",)) == P("data")
    with pytest.raises(TypeError, match=r"batch_spec=<function .*> is not a PartitionSpec"):
        as_spec(fn, what="batch_spec")


def test_entry_axes_and_mesh_names():
    assert entry_axes(("data", "model")) == ("data", "model")
    assert describe_mesh(MESH) == "Mesh(data=4, model=2)"
