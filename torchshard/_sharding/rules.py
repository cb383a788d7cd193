"""Regex rule tables that map state_dict names to partition specs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from torchshard._base.errors import ArgumentError, raise_if_any
from torchshard._base.specs import SPEC_HINT, RuleSpecLike, SpecFn, TensorInfo, as_rule_spec
from torchshard._base.validate import compiled, regex_problem


class SpecTransform:
    """Rewrites a resolved spec (e.g. adds an FSDP axis); subclasses implement `__call__`."""

    @property
    def label(self) -> str:
        """How plan tables name this transform."""
        return "transform"

    def __call__(self, info: TensorInfo, spec: PartitionSpec) -> PartitionSpec:
        raise NotImplementedError

    def problems(self, mesh: Mesh | AbstractMesh) -> list[str]:
        """What makes this transform unusable on ``mesh`` (e.g. an unknown axis); empty if nothing."""
        return []

    def name_problems(self, names: Sequence[str]) -> list[str]:
        """What this transform names that the model lacks (``names``: every tensor's); empty if nothing."""
        return []


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of a rule table: a regex over state_dict names and the spec for matching tensors."""

    pattern: str
    spec: PartitionSpec | SpecFn
    source: str = "rules"
    warn_unused: bool = True

    @property
    def regex(self) -> re.Pattern[str]:
        return compiled(self.pattern)

    def matches(self, name: str) -> bool:
        return self.regex.fullmatch(name) is not None

    def resolve(self, info: TensorInfo) -> PartitionSpec:
        return self.spec(info) if callable(self.spec) and not isinstance(self.spec, PartitionSpec) else self.spec

    def describe(self) -> str:
        spec = getattr(self.spec, "label", None) or str(self.spec)
        return f"{self.pattern!r} → {spec}" + ("" if self.source == "rules" else f" [{self.source}]")


def _check_row(row: Any, index: int) -> str | None:
    if isinstance(row, Rule):
        return None
    if not isinstance(row, tuple | list) or len(row) != 2 or not isinstance(row[0], str):
        return f"rule #{index} {row!r} is not a (pattern, spec) pair; write e.g. (r'.*\\.weight', ('data', None))"
    problem = regex_problem(row[0])
    if problem is not None:
        return f"rule #{index} pattern {row[0]!r} {problem}; escape dots and brackets"
    if as_rule_spec(row[1]) is None:
        return f"rule #{index} ({row[0]!r}) spec {row[1]!r} is not {SPEC_HINT} or P(('data', 'model'))"
    return None


def _row_list(rows: Any) -> list[Any]:
    if isinstance(rows, Mapping):
        return list(rows.items())
    if isinstance(rows, set | frozenset):
        raise ArgumentError(
            f"rules is a {type(rows).__name__} of {len(rows)} rows, which has no order, but the first matching rule "
            f"wins; pass a list of (pattern, spec) pairs in the order they should be tried"
        )
    if isinstance(rows, str | bytes) or not isinstance(rows, Iterable):
        raise ArgumentError(
            f"rules must be a list of (pattern, spec) pairs (or a dict pattern → spec), got {type(rows).__name__} "
            f"{rows!r:.60}; write e.g. Rules([(r'.*\\.weight', ('data', None))])"
        )
    return list(rows)


def _option_problems(transforms: Any, source: Any) -> list[str]:
    problems = [] if isinstance(source, str) else [f"source={source!r} must be a str (the label plan tables show)"]
    if isinstance(transforms, str | bytes) or not isinstance(transforms, Iterable):
        return [*problems, f"transforms={transforms!r:.60} must be a list of SpecTransform (e.g. presets.fsdp())"]
    return problems + [
        f"transforms[{i}] is a {type(t).__name__}, not a SpecTransform; use e.g. presets.fsdp().transforms"
        for i, t in enumerate(transforms)
        if not isinstance(t, SpecTransform)
    ]


def _to_rule(row: Any, source: str) -> Rule:
    if isinstance(row, Rule):
        return row
    spec = as_rule_spec(row[1])
    assert spec is not None  # _check_row rejected the rest
    return Rule(row[0], spec, source)


class Rules:
    """An ordered table of ``(regex, spec)`` rules; the first ``re.fullmatch`` wins.

    Args:
        rows: ``(pattern, spec)`` pairs (or a dict pattern → spec); ``spec`` is a ``PartitionSpec``,
            a tuple of mesh-axis names / ``None`` / tuples of names, ``None`` (replicated), or a
            callable ``TensorInfo -> PartitionSpec``.
        transforms: spec rewrites applied after matching (e.g. FSDP adding its axis).
        source: label shown in plan tables for these rules.

    Raises:
        ShardingError: every malformed row, at once.
        ArgumentError: ``rows`` is not a list of rows (e.g. one string).

    Examples:
        >>> rules = Rules([(r".*\\.weight", ("model", None)), (r".*", ())])
        >>> rules.spec_for("fc.weight")
        P('model', None)
    """

    def __init__(
        self,
        rows: Iterable[Rule | tuple[str, RuleSpecLike]] = (),
        *,
        transforms: Sequence[SpecTransform] = (),
        source: str = "rules",
    ) -> None:
        raise_if_any(_option_problems(transforms, source), header="invalid Rules() arguments", error=ArgumentError)
        rows = _row_list(rows)
        problems = [p for i, row in enumerate(rows) if (p := _check_row(row, i)) is not None]
        raise_if_any(problems, header="invalid rule table")
        self._rules = tuple(_to_rule(row, source) for row in rows)
        self._transforms = tuple(transforms)

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self._rules

    @property
    def transforms(self) -> tuple[SpecTransform, ...]:
        return self._transforms

    def __add__(self, other: Rules) -> Rules:
        if not isinstance(other, Rules):
            raise _addition_error(other)
        return Rules(self._rules + other._rules, transforms=self._transforms + other._transforms)

    def __radd__(self, other: Any) -> Rules:
        raise _addition_error(other)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        rows = "".join(f"\n  {r.describe()}," for r in self._rules)
        extra = f", transforms={[t.label for t in self._transforms]}" if self._transforms else ""
        return f"Rules([{rows}\n]{extra})"

    def match(self, name: str) -> Rule | None:
        """The first rule whose pattern fully matches ``name``, or None."""
        return next((r for r in self._rules if r.matches(name)), None)

    def spec_for(self, name: str, info: TensorInfo | None = None) -> PartitionSpec | SpecFn | None:
        """The spec of the first matching rule (resolved with ``info`` if it is shape-dependent), or None."""
        rule = self.match(name)
        if rule is None:
            return None
        return rule.resolve(info) if info is not None else rule.spec


def _addition_error(other: Any) -> ArgumentError:
    return ArgumentError(
        f"Rules can only be added to Rules, got {type(other).__name__} {other!r:.60}; wrap it: Rules([...]) + rules"
    )


def as_rules(rules: Rules | Iterable[Any] | None) -> Rules:
    """Accepts a `Rules`, a list of pairs, a dict pattern → spec, or None."""
    if rules is None:
        return Rules()
    return rules if isinstance(rules, Rules) else Rules(rules)


def annotation_rules(model: torch.nn.Module) -> Rules:
    """Rules from ``shard_rules`` attributes of submodules, prefixed, deeper modules first."""
    found = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        rows = getattr(module, "shard_rules", None)
        if not rows:
            continue
        table = Rules(rows, source=f"{type(module).__name__}.shard_rules")
        head = re.escape(prefix + ".") if prefix else ""
        depth = prefix.count(".") + 1 if prefix else 0
        found += [(depth, dataclasses.replace(r, pattern=head + f"(?:{r.pattern})")) for r in table]
    found.sort(key=lambda pair: -pair[0])
    return Rules([rule for _, rule in found])
