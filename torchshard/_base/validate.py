"""One vocabulary of checks: specs against meshes and shapes, name/shape mismatches, and public arguments."""

from __future__ import annotations

import difflib
import functools
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from torchshard._base.errors import ArgumentError, ShardingError, raise_if_any
from torchshard._base.specs import entry_axes

AnyMesh = Mesh | AbstractMesh
Shape = Sequence[int]


def describe_mesh(mesh: AnyMesh) -> str:
    """``Mesh(data=4, model=2)``: the short form every message uses.

    Examples:
        >>> describe_mesh(AbstractMesh((4, 2), ("data", "model")))
        'Mesh(data=4, model=2)'
    """
    return "Mesh(" + ", ".join(f"{k}={v}" for k, v in mesh.shape.items()) + ")"


def axis_problems(where: str, spec: PartitionSpec, mesh: AnyMesh) -> list[str]:
    """Axes of ``spec`` that ``mesh`` lacks, and axes it uses twice."""
    problems, seen = [], set()
    for entry in spec:
        for axis in entry_axes(entry):
            if axis not in mesh.shape:
                problems.append(f"{where}: unknown mesh axis {axis!r}; use one of {list(mesh.shape)}")
            elif axis in seen:  # one at a time, so ('data', 'data') in a single entry counts too
                problems.append(f"{where}: mesh axis {axis!r} is used twice; each axis may shard one dim only")
            seen.add(axis)
    return problems


def _divisible_fix(multiple: int) -> str:
    return f"pad the dim to a multiple of {multiple}, shard another dim, or replicate it"


def spec_problems(
    name: str,
    shape: Shape,
    spec: PartitionSpec,
    mesh: AnyMesh,
    *,
    factors: Mapping[int, tuple[str, int]] | None = None,
    fix: Callable[[int], str] = _divisible_fix,
) -> list[str]:
    """Everything that stops ``spec`` from sharding a tensor of ``shape`` on ``mesh``.

    Args:
        name: how messages name the tensor.
        shape: its shape.
        spec: the spec to check.
        mesh: the mesh.
        factors: dim → (name, k): that dim must also split k ways (e.g. micro-batches).
        fix: the advice for a dim that does not divide, given the multiple it needs.

    Returns:
        One message per problem (rank, unknown or repeated axes, indivisible dims); empty if none.

    Examples:
        >>> mesh = AbstractMesh((4, 2), ("data", "model"))
        >>> spec_problems("w", (6, 8), PartitionSpec("data"), mesh)
        ["w (6, 8) spec P('data',) on Mesh(data=4, model=2): dim 0 (size 6) is not divisible by data (size 4); ..."]
    """
    where = f"{name} {tuple(shape)} spec {spec} on {describe_mesh(mesh)}"
    if len(spec) > len(shape):
        rank = len(shape)
        return [f"{where}: spec has {len(spec)} entries but the tensor has rank {rank}; give at most {rank}"]
    problems = axis_problems(where, spec, mesh)
    for dim in range(len(shape)):
        axes = entry_axes(spec[dim]) if dim < len(spec) else ()
        if any(a not in mesh.shape for a in axes):
            continue
        size = math.prod(mesh.shape[a] for a in axes)
        label, k = (factors or {}).get(dim, ("", 1))
        if shape[dim] % (size * k) == 0 or (size * k) == 1:
            continue
        over = f"{' × '.join(axes)} (size {size})" if axes else ""
        extra = f"{label} {k}" if k > 1 else ""
        by = " × ".join(p for p in (over, extra) if p)
        problems.append(f"{where}: dim {dim} (size {shape[dim]}) is not divisible by {by}; {fix(size * k)}")
    return problems


def mismatch_problems(
    expected: Mapping[str, Shape],
    found: Mapping[str, Shape],
    *,
    expected_in: str,
    found_in: str,
    what: str = "",
) -> list[str]:
    """Like torch's strict ``load_state_dict``: every missing, unexpected and mis-shaped name.

    Args:
        expected: name → shape of what should be there (e.g. the model's tensors).
        found: name → shape of what is there (e.g. the checkpoint's).
        expected_in: what ``expected`` describes, e.g. ``"model"``.
        found_in: what ``found`` describes, e.g. ``"checkpoint"``.
        what: a word before each name, e.g. ``"optimizer leaf "``.

    Examples:
        >>> found = mismatch_problems({"a": (2,), "b": (3,)}, {"b": (4,), "c": ()}, expected_in="model",
        ...                           found_in="checkpoint")
        >>> print(*found, sep="\\n")
        missing a (2,): in the model, not in the checkpoint
        unexpected c (): in the checkpoint, not in the model
        mis-shaped b: checkpoint (4,), model (3,)
    """
    problems = [
        f"missing {what}{n} {tuple(s)}: in the {expected_in}, not in the {found_in}"
        for n, s in expected.items()
        if n not in found
    ]
    problems += [
        f"unexpected {what}{n} {tuple(s)}: in the {found_in}, not in the {expected_in}"
        for n, s in found.items()
        if n not in expected
    ]
    return problems + [
        f"mis-shaped {what}{n}: {found_in} {tuple(found[n])}, {expected_in} {tuple(s)}"
        for n, s in expected.items()
        if n in found and tuple(found[n]) != tuple(s)
    ]


def int_problems(name: str, value: Any, *, minimum: int, none: str | None = None) -> list[str]:
    """``value`` must be an int ≥ ``minimum`` (``bool`` is not an int here); None too if ``none`` says what it means.

    Examples:
        >>> int_problems("grad_accum_steps", True, minimum=1)
        ['grad_accum_steps=True must be an int ≥ 1']
    """
    if value is None and none is not None:
        return []
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return []
    alternative = f" or None ({none})" if none is not None else ""
    return [f"{name}={value!r} must be an int ≥ {minimum}{alternative}"]


def instance_problems(name: str, value: Any, kind: type | tuple[type, ...], expected: str) -> list[str]:
    """``value`` must be an instance of ``kind``; ``expected`` says what it should be and where it comes from.

    Examples:
        >>> instance_problems("plan", {}, tuple, "a ShardingPlan from torchshard.plan()")
        ['plan must be a ShardingPlan from torchshard.plan(), got dict']
    """
    return [] if isinstance(value, kind) else [f"{name} must be {expected}, got {type(value).__name__}"]


@functools.lru_cache(maxsize=4096)
def _checked_compile(pattern: str) -> tuple[re.Pattern[str] | None, str | None]:
    with warnings.catch_warnings(record=True) as caught:
        # Python warns (a FutureWarning, an error under -W error) of a set whose meaning a later
        # Python will change ('[[', '&&', '--', '~~' inside [...]): seen here, never raised.
        # re.UNICODE, redundant for str patterns, keys re's cache apart from plain compiles, so the
        # pattern is parsed (and the warning seen) even if the program compiled it before.
        warnings.simplefilter("always", FutureWarning)
        try:
            compiled = re.compile(pattern, re.UNICODE)
        except re.error as err:
            return None, f"is not a valid regex ({err})"
    ambiguous = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    if ambiguous:
        return None, (
            f"is ambiguous: Python warns '{ambiguous[0]}' (a future Python will read it differently); escape a "
            f"literal '[', '&', '-', '~' or '|' inside [...] with a backslash"
        )
    return compiled, None


def regex_problem(pattern: Any) -> str | None:
    """Why ``pattern`` cannot be a regex, as a phrase after its name; None for a usable one.

    Every regex torchshard takes from a user (rules, remat, expert patterns, tp_plan keys, plan
    filters) goes through this one check and `compiled`, so a bad one is always a
    `ShardingError` and never a warning or ``re.error`` from Python's ``re``.

    Examples:
        >>> regex_problem(r"layers\\.\\d+") is None
        True
        >>> regex_problem("layers.(")
        'is not a valid regex (missing ), unterminated subpattern at position 7)'
        >>> regex_problem("[[a]")
        "is ambiguous: Python warns 'Possible nested set at position 1' (a future Python will read it ...; ..."
    """
    if not isinstance(pattern, str):
        return f"is a {type(pattern).__name__}, not a regex string"
    return _checked_compile(pattern)[1]


def compiled(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled through the check of `regex_problem` (cached).

    Raises:
        ShardingError: the pattern is not a usable regex (callers check arguments first, to list every problem).

    Examples:
        >>> compiled(r"fc\\d").fullmatch("fc1") is not None
        True
    """
    if not isinstance(pattern, str):
        raise ArgumentError([f"regex {pattern!r} {regex_problem(pattern)}"], header="invalid regex")
    made, problem = _checked_compile(pattern)
    if made is None:
        raise ShardingError(f"regex {pattern!r} {problem}")
    return made


def closest_names(pattern: str, names: Sequence[str]) -> list[str]:
    """Up to three of ``names`` closest to the regex ``pattern`` read as text (its escapes dropped)."""
    return difflib.get_close_matches(pattern.replace("\\", ""), names, n=3, cutoff=0.3)


def raise_for_arguments(problems: Sequence[str], *, header: str) -> None:
    """Raises one `ArgumentError` (a ``TypeError`` and a `ShardingError`) listing every bad argument."""
    raise_if_any(problems, header=header, error=ArgumentError)
