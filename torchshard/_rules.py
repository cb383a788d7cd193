"""Regex rule tables that map state_dict names to partition specs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from jax.sharding import Mesh, PartitionSpec

from torchshard._errors import raise_if_any


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What a rule may look at to choose a spec: the tensor's name, shape, dtype, owner and the mesh."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    module_type: type | None
    mesh: Mesh


SpecFn = Callable[[TensorInfo], PartitionSpec]
SpecLike = PartitionSpec | Sequence[Any] | SpecFn | None


class SpecTransform:
    """Rewrites a resolved spec (e.g. adds an FSDP axis); subclasses implement `__call__`."""

    label: str = "transform"

    def __call__(self, info: TensorInfo, spec: PartitionSpec) -> PartitionSpec:
        raise NotImplementedError

    def problems(self, mesh: Mesh) -> list[str]:
        """What makes this transform unusable on ``mesh`` (e.g. an unknown axis); empty if nothing."""
        return []


def entry_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes one spec entry shards over: ``None`` → (), ``"data"`` → ("data",), tuples as they are."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry_ok(entry: Any) -> bool:
    if entry is None or isinstance(entry, str):
        return True
    return isinstance(entry, tuple | list) and all(isinstance(a, str) for a in entry)


def to_spec(spec: SpecLike) -> PartitionSpec | SpecFn:
    """Normalises a rule's spec: tuples/lists/None become a `PartitionSpec`; callables stay as they are."""
    if spec is None:
        return PartitionSpec()
    if isinstance(spec, PartitionSpec) or callable(spec):
        return spec
    if isinstance(spec, str):
        return PartitionSpec(spec)
    if isinstance(spec, tuple | list) and all(_entry_ok(e) for e in spec):
        return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in spec))
    raise TypeError(spec)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of a rule table: a regex over state_dict names and the spec for matching tensors."""

    pattern: str
    spec: PartitionSpec | SpecFn
    source: str = "rules"
    warn_unused: bool = True

    @property
    def regex(self) -> re.Pattern[str]:
        return re.compile(self.pattern)

    def matches(self, name: str) -> bool:
        return self.regex.fullmatch(name) is not None

    def resolve(self, info: TensorInfo) -> PartitionSpec:
        return self.spec(info) if callable(self.spec) else self.spec

    def describe(self) -> str:
        spec = getattr(self.spec, "label", None) or str(self.spec)
        return f"{self.pattern!r} → {spec}" + ("" if self.source == "rules" else f" [{self.source}]")


def _check_row(row: Any, index: int) -> str | None:
    if isinstance(row, Rule):
        return None
    if not isinstance(row, tuple | list) or len(row) != 2 or not isinstance(row[0], str):
        return f"rule #{index} {row!r} is not a (pattern, spec) pair; write e.g. (r'.*\\.weight', ('data', None))"
    try:
        re.compile(row[0])
    except re.error as err:
        return f"rule #{index} pattern {row[0]!r} is not a valid regex ({err}); escape dots and brackets"
    try:
        to_spec(row[1])
    except TypeError:
        return (
            f"rule #{index} ({row[0]!r}) spec {row[1]!r} is not a PartitionSpec or a tuple of axis names / "
            f"None / tuples of names; write e.g. ('data', None) or P(('data', 'model'))"
        )
    return None


def _to_rule(row: Any, source: str) -> Rule:
    return row if isinstance(row, Rule) else Rule(row[0], to_spec(row[1]), source)


class Rules:
    """An ordered table of ``(regex, spec)`` rules; the first ``re.fullmatch`` wins.

    Args:
        rows: ``(pattern, spec)`` pairs; ``spec`` is a ``PartitionSpec``, a tuple of mesh-axis
            names / ``None`` / tuples of names, ``None`` (replicated), or a callable
            ``TensorInfo -> PartitionSpec``.
        transforms: spec rewrites applied after matching (e.g. FSDP adding its axis).
        source: label shown in plan tables for these rules.

    Raises:
        ShardingError: every malformed row, at once.

    Example:
        >>> rules = Rules([(r".*\\.weight", ("model", None)), (r".*", ())])
        >>> rules.spec_for("fc.weight")
        P('model', None)
    """

    def __init__(
        self,
        rows: Iterable[Any] = (),
        *,
        transforms: Sequence[SpecTransform] = (),
        source: str = "rules",
    ) -> None:
        rows = list(rows)
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
            return NotImplemented
        return Rules(self._rules + other._rules, transforms=self._transforms + other._transforms)

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


def as_rules(rules: Rules | Iterable[Any] | None) -> Rules:
    """Accepts a `Rules`, a list of pairs, or None."""
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
