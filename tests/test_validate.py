"""The validation vocabulary: spec problems, name/shape mismatches and argument checks, message by message."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from torchshard import ArgumentError, ShardingError
from torchshard._base.errors import raise_if_any
from torchshard._base.specs import as_rule_spec, as_spec, entry_axes, parse_spec
from torchshard._base.validate import (
    compiled,
    describe_mesh,
    instance_problems,
    int_problems,
    mismatch_problems,
    raise_for_arguments,
    regex_problem,
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


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        (r"layers\.\d+", None),
        ("[[", r"is not a valid regex \(unterminated character set at position 0\)"),
        ("[[a]", r"is ambiguous: Python warns 'Possible nested set at position 1'.*escape a literal '\['"),
        ("[a&&b]", r"is ambiguous: Python warns 'Possible set intersection at position 2'"),
        ("[a~~b]", r"is ambiguous: Python warns 'Possible set symmetric difference at position 2'"),
        (3, r"is a int, not a regex string"),
    ],
)
def test_regex_problem(pattern, problem):
    found = regex_problem(pattern)
    assert found is None if problem is None else re.match(problem, found), found


def test_a_regex_python_compiled_before_is_still_judged_the_same():
    """re caches compiled patterns and warns only when it parses one: the check must not depend on that."""
    with pytest.warns(FutureWarning):
        re.compile("[[b]")
    assert regex_problem("[[b]") is not None
    with pytest.raises(ShardingError, match=r"regex '\[\[b\]' is ambiguous"):
        compiled("[[b]")


# every public entry that takes a regex, called as a user would under `python -W error`
ENTRIES = {
    "Rules": "ts.Rules([(PATTERN, ())])",
    "Remat": "ts.Remat(PATTERN)",
    "Trainer(remat=)": "ts.Trainer(model, lambda m, b: m(b).sum(), optax.sgd(0.1), plan, remat=PATTERN)",
    "tensor_parallel": "ts.presets.tensor_parallel(colwise=[PATTERN])",
    "expert_parallel": "ts.presets.expert_parallel([PATTERN])",
    "from_hf_tp_plan": "ts.presets.from_hf_tp_plan({PATTERN: 'colwise'})",
    "visualize_plan": "ts.visualize_plan(plan, names=PATTERN)",
}


@pytest.mark.slow
def test_no_regex_entry_lets_pythons_warning_or_error_through_under_w_error():
    script = textwrap.dedent(
        """
        import torchshard as ts
        ts.use_cpu_devices(8)
        import optax, torch
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        plan = ts.plan(model, ts.make_mesh({"data": 8}))
        for entry, call in ENTRIES.items():
            for PATTERN in ["[[a]", "[[", "x("]:
                try:
                    eval(call)
                except ts.ShardingError as e:
                    print(entry, repr(PATTERN), "ShardingError")
                except BaseException as e:
                    print(entry, repr(PATTERN), type(e).__name__, str(e)[:80])
                else:
                    print(entry, repr(PATTERN), "accepted")
        """
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", f"ENTRIES = {ENTRIES!r}\n{script}"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3 * len(ENTRIES), done.stdout
    # a tp_plan key is a module path, not a regex ('*' = a layer index): its characters are literal
    odd = [line for line in lines if not line.endswith("ShardingError") and not line.startswith("from_hf_tp_plan")]
    assert odd == [], "\n".join(odd)
