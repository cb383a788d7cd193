"""ShardingPlan: every state_dict tensor resolved to a validated NamedSharding."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError, UnusedRuleWarning, raise_if_any
from torchshard._base.format import fmt_bytes, fmt_shape, table
from torchshard._base.specs import SPEC_HINT, parse_spec
from torchshard._base.validate import (
    closest_names,
    describe_mesh,
    instance_problems,
    raise_for_arguments,
    spec_problems,
)
from torchshard._bridge.module_tensors import Kind, ModuleTensor, model_tensors, tie_groups
from torchshard._sharding.rules import Rule, Rules, TensorInfo, annotation_rules, as_rules


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """One tensor of a plan: where it lives and which rule put it there."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: PartitionSpec
    sharding: NamedSharding
    rule: str
    kind: Kind
    tied_to: str | None = None
    group: str | None = None  # the device group whose devices alone hold it (None: all), as a strategy laid it out

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return tuple(self.sharding.shard_shape(self.shape))

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shard_shape) * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def fullest_device_bytes(entries: Iterable[PlanEntry], size: Callable[[PlanEntry], int]) -> int:
    """``size`` summed as the fullest device holds ``entries``: those on every device plus the fullest group's.

    A tensor with a `PlanEntry.group` lives on that group's devices alone (a pipeline's stage holds its layers),
    so a device holds the tensors without a group and those of one group; the largest such sum is what must fit.
    """
    per_group: dict[str | None, int] = {}
    for e in entries:
        per_group[e.group] = per_group.get(e.group, 0) + size(e)
    return per_group.pop(None, 0) + max(per_group.values(), default=0)


@dataclasses.dataclass(frozen=True)
class PlanColumn:
    """A column a strategy adds to a plan's table (after ``spec``) and rows: its header, each tensor's value
    (JSON-ready, by name; a tied alias shows its tensor's) and what a tensor without one shows in the table.

    Examples:
        >>> PlanColumn("stage", {"layers.0.weight": 0}).cell("head.weight")
        'all'
    """

    header: str
    values: Mapping[str, Any]
    missing: str = "all"

    def cell(self, name: str) -> str:
        value = self.values.get(name)
        return self.missing if value is None else str(value)


class ShardingPlan(Mapping[str, NamedSharding]):
    """A read-only mapping ``state_dict name → NamedSharding`` with the details behind each choice.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> p = plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=1024))
        >>> print(p.table())
        name      shape  dtype    spec             rule                              shard/device  bytes/device
        --------  -----  -------  ---------------  --------------------------------  ------------  ------------
        0.weight  64×16  float32  P('data', None)  default: replicate +fsdp('data')  8×16          512 B
        0.bias    64     float32  P()              default: replicate                64            256 B
        2.weight  4×64   float32  P()              default: replicate                4×64          1.00 KiB
        2.bias    4      float32  P()              default: replicate                4             16 B
        Mesh(data=8): 4 tensors, 5.27 KiB in all, 1.77 KiB per device (33.5% of the model)
    """

    def __init__(
        self, mesh: Mesh | AbstractMesh, entries: Iterable[PlanEntry], columns: Iterable[PlanColumn] = ()
    ) -> None:
        self._mesh = mesh
        self._entries = {e.name: e for e in entries}
        self._columns = tuple(columns)

    @property
    def mesh(self) -> Mesh | AbstractMesh:
        return self._mesh

    @property
    def entries(self) -> Mapping[str, PlanEntry]:
        return dict(self._entries)

    def __getitem__(self, name: str) -> NamedSharding:
        return self._entries[name].sharding

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def spec(self, name: str) -> PartitionSpec:
        return self._entries[name].spec

    def canonical(self, name: str) -> str:
        """The name a tied tensor is stored under (itself if untied)."""
        return self._entries[name].tied_to or name

    def unique_entries(self) -> list[PlanEntry]:
        """One entry per distinct tensor (tied aliases left out)."""
        return [e for e in self._entries.values() if e.tied_to is None]

    def bytes_per_device(self, kind: Kind | None = None) -> int:
        """Bytes each device holds for this plan's tensors (tied tensors counted once; the fullest group's)."""
        entries = [e for e in self.unique_entries() if kind in (None, e.kind)]
        return fullest_device_bytes(entries, lambda e: e.bytes_per_device)

    def with_groups(self, groups: Mapping[str, str], *columns: PlanColumn) -> ShardingPlan:
        """This plan with the device group that alone holds each named tensor (`PlanEntry.group`; a tied alias
        goes with its tensor) and ``columns`` added to its table: how a strategy's rewrite lays tensors out
        (a pipelined Trainer's ``plan``: each layer on its stage).

        Examples:
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            >>> p = plan(model, ts.make_mesh({"data": 8})).with_groups({"1.weight": "b", "1.bias": "b"})
            >>> p.entries["1.weight"].group, p.entries["0.weight"].group, p.bytes_per_device()
            ('b', None, 160)
        """
        entries = [dataclasses.replace(e, group=groups.get(e.tied_to or e.name)) for e in self._entries.values()]
        return ShardingPlan(self._mesh, entries, (*self._columns, *columns))

    def total_bytes(self) -> int:
        """Bytes of the unsharded model (tied tensors counted once)."""
        return sum(e.total_bytes for e in self.unique_entries())

    def diff(self, other: ShardingPlan) -> dict[str, tuple[PartitionSpec | None, PartitionSpec | None]]:
        """Names whose spec differs between two plans: name → (spec here, spec there)."""
        names = list(self) + [n for n in other if n not in self]
        spec = lambda p, n: p.spec(n) if n in p else None  # noqa: E731
        return {n: (spec(self, n), spec(other, n)) for n in names if spec(self, n) != spec(other, n)}

    def rows(self) -> list[dict[str, Any]]:
        """The table as dicts (for JSON output)."""
        return [
            {
                "name": e.name,
                "kind": e.kind,
                "shape": list(e.shape),
                "dtype": str(e.dtype).removeprefix("torch."),
                "spec": str(e.spec),
                "rule": e.rule,
                "shard_shape": list(e.shard_shape),
                "bytes_per_device": 0 if e.tied_to else e.bytes_per_device,
                "tied_to": e.tied_to,
            }
            | {c.header: c.values.get(e.tied_to or e.name) for c in self._columns}
            for e in self._entries.values()
        ]

    def table(self) -> str:
        """A text table: name, shape, dtype, spec, rule, per-device shard shape and bytes, totals.

        A strategy's columns (`with_groups`) follow ``spec``: a pipelined Trainer's ``stage``, the stage whose
        devices alone hold the tensor.
        """
        head: tuple[str, ...] = ("name", "shape", "dtype", "spec", "rule", "shard/device", "bytes/device")
        body: list[tuple[str, ...]] = [
            (
                r["name"],
                fmt_shape(r["shape"]),
                r["dtype"],
                r["spec"],
                f"tied to {r['tied_to']}" if r["tied_to"] else r["rule"],
                fmt_shape(r["shard_shape"]),
                fmt_bytes(r["bytes_per_device"]),
            )
            for r in self.rows()
        ]
        if self._columns:
            head = (*head[:4], *(c.header for c in self._columns), *head[4:])
            cells = [[c.cell(e.tied_to or e.name) for c in self._columns] for e in self._entries.values()]
            body = [(*row[:4], *more, *row[4:]) for row, more in zip(body, cells, strict=True)]
        total = self.total_bytes()
        per_device = self.bytes_per_device()
        foot = (
            f"{describe_mesh(self._mesh)}: {len(self.unique_entries())} tensors, "
            f"{fmt_bytes(total)} in all, {fmt_bytes(per_device)} per device "
            f"({per_device / max(total, 1):.1%} of the model)"
        )
        return table(head, body, foot)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"ShardingPlan({describe_mesh(self._mesh)}, {len(self)} tensors)"


@dataclasses.dataclass(frozen=True)
class _Resolved:
    spec: PartitionSpec
    rule: str
    explicit: bool


def _rule_spec(rule: Rule, info: TensorInfo) -> PartitionSpec | str:
    """The spec ``rule`` gives this tensor, or why its callable spec gave none."""
    where = f"{info.name} {info.shape}: rule {rule.describe()}"
    try:
        spec = rule.resolve(info)
    except Exception as e:  # the user's callable: say which rule and tensor it failed on, keep its traceback
        raise ShardingError(f"{where} raised {type(e).__name__}: {e}; fix the callable spec") from e
    made = parse_spec(spec)
    return made if made is not None else f"{where} returned {spec!r:.60}, not {SPEC_HINT}"


def _resolve_one(info: TensorInfo, table: list[Rule], rules: Rules, default: str) -> _Resolved | str | None:
    rule = next((r for r in table if r.matches(info.name)), None)
    if rule is None and default == "error":
        return None
    spec = _rule_spec(rule, info) if rule else PartitionSpec()
    if isinstance(spec, str):
        return spec
    label = rule.describe() if rule else "default: replicate"
    for transform in rules.transforms:
        new = transform(info, spec)
        if new != spec:
            spec, label = new, f"{label} {transform.label}"
    return _Resolved(spec, label, rule is not None)


def _same_sharding_key(spec: PartitionSpec) -> tuple[Any, ...]:
    """``P('a')``, ``P('a', None)`` and ``P(('a',), None)`` shard alike; they get one key."""
    entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _tie_problems(resolved: Mapping[str, _Resolved], ties: Mapping[str, str], mesh: Any) -> list[str]:
    groups: dict[str, list[str]] = {}
    for name, canon in ties.items():
        groups.setdefault(canon, []).append(name)
    problems = []
    for names in groups.values():
        specs = {_same_sharding_key(resolved[n].spec) for n in names if n in resolved and resolved[n].explicit}
        if len(specs) > 1:
            explicit = [n for n in names if n in resolved and resolved[n].explicit]
            detail = ", ".join(f"{n} → {resolved[n].spec} ({resolved[n].rule})" for n in explicit)
            problems.append(
                f"tied tensor {' = '.join(names)} on {describe_mesh(mesh)} gets conflicting specs: {detail}; "
                f"a tied tensor has one sharding, make its rules agree"
            )
    return problems


def _tie_choice(names: list[str], resolved: Mapping[str, _Resolved]) -> _Resolved:
    return next((resolved[n] for n in names if resolved[n].explicit), resolved[names[0]])


def _warn_unused(table: list[Rule], names: list[str]) -> None:
    for rule in table:
        if rule.warn_unused and not any(rule.matches(n) for n in names):
            close = closest_names(rule.pattern, names)
            hint = f"; closest names: {close}" if close else ""
            warnings.warn(f"rule {rule.describe()} matched no tensor{hint}", UnusedRuleWarning, stacklevel=3)


def plan(
    model: torch.nn.Module,
    mesh: Mesh | AbstractMesh,
    rules: Rules | Iterable[Any] | None = None,
    *,
    default: Literal["replicate", "error"] = "replicate",
) -> ShardingPlan:
    """Resolves every parameter and buffer of ``model`` to a validated ``NamedSharding``.

    Explicit ``rules`` are tried first, then ``shard_rules`` annotations (deeper modules
    first), then ``default``. Works on models built on the ``meta`` device.

    Args:
        model: the torch module (any device, ``meta`` included).
        mesh: from `make_mesh` (an ``AbstractMesh`` plans without devices).
        rules: a `Rules` table or a list of ``(pattern, spec)`` pairs.
        default: ``"replicate"`` unmatched tensors, or ``"error"`` to list them as problems.

    Returns:
        The `ShardingPlan`.

    Raises:
        ArgumentError: ``model`` is not a module (e.g. its state_dict), ``mesh`` not a mesh, a
            bad ``default``, or ``rules`` not a rule table (one string, a set: no order).
        ShardingError: every problem at once (unknown axis, rank, divisibility, repeated axis,
            unmatched names, conflicting specs of a tied tensor, a callable spec that returned
            no spec); a callable spec that raised (its exception chained). ``model`` is never
            changed.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> p = plan(model, ts.make_mesh({"data": 4, "model": 2}), [(r"0\\.weight", ("model", None))])
        >>> p.spec("0.weight"), p.spec("2.weight")
        (P('model', None), P())
        >>> plan(model, ts.make_mesh({"data": 8}), [(r"2\\.weight", ("data", None))])
        Traceback (most recent call last):
        ...
        torchshard._base.errors.ShardingError: invalid sharding plan for Sequential on Mesh(data=8) (1 problem):
          - 2.weight (4, 64) spec P('data', None) on Mesh(data=8): dim 0 (size 4) is not divisible by data (size 8); ...
    """
    _check_plan_args(model, mesh, default)
    rules = as_rules(rules)
    table = list(rules) + list(annotation_rules(model))
    tensors = model_tensors(model)
    ties = tie_groups(tensors)
    resolved, problems = {}, [p for transform in rules.transforms for p in transform.problems(mesh)]
    for t in tensors:
        info = TensorInfo(t.name, tuple(t.tensor.shape), t.tensor.dtype, t.module_type, mesh)
        got = _resolve_one(info, table, rules, default)
        if got is None:
            problems.append(
                f"{t.name} {tuple(t.tensor.shape)} on {describe_mesh(mesh)}: no rule matches and "
                f"default='error'; add a rule for it (e.g. ({t.name!r}, ())) or use default='replicate'"
            )
        elif isinstance(got, str):
            problems.append(got)
        else:
            resolved[t.name] = got
            problems += spec_problems(t.name, info.shape, got.spec, mesh)
    problems += _tie_problems(resolved, ties, mesh)
    problems += [p for transform in rules.transforms for p in transform.name_problems([t.name for t in tensors])]
    raise_if_any(problems, header=f"invalid sharding plan for {type(model).__name__} on {describe_mesh(mesh)}")
    _warn_unused(table, [t.name for t in tensors])
    return ShardingPlan(mesh, _entries(tensors, ties, resolved, mesh))


def _check_plan_args(model: Any, mesh: Any, default: Any) -> None:
    problems = instance_problems("model", model, torch.nn.Module, "a torch.nn.Module (not its state_dict)")
    problems += instance_problems("mesh", mesh, (Mesh, AbstractMesh), "a jax Mesh, e.g. make_mesh({'data': 8})")
    if default not in ("replicate", "error"):
        problems.append(f"default={default!r} must be 'replicate' or 'error'")
    raise_for_arguments(problems, header="invalid plan() arguments")


def _entries(tensors: list[ModuleTensor], ties: Mapping[str, str], resolved: Mapping[str, _Resolved], mesh: Any):
    groups: dict[str, list[str]] = {}
    for name, canon in ties.items():
        groups.setdefault(canon, []).append(name)
    for t in tensors:
        canon = ties[t.name]
        chosen = _tie_choice(groups[canon], resolved)
        yield PlanEntry(
            name=t.name,
            shape=tuple(t.tensor.shape),
            dtype=t.tensor.dtype,
            spec=chosen.spec,
            sharding=NamedSharding(mesh, chosen.spec),
            rule=chosen.rule,
            kind=t.kind,
            tied_to=None if canon == t.name else canon,
        )
