"""What a compiled step communicates: its collectives, counted and sized per kind and mesh axes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import torch
from jax.sharding import Mesh, NamedSharding

from torchshard._base.errors import ArgumentError, ShardingError
from torchshard._base.format import fmt_bytes, table
from torchshard._base.validate import describe_mesh
from torchshard._bridge.tensors import unwrap
from torchshard._hlo.costs import collective_runs
from torchshard._hlo.hlo import KINDS, Collective, axes_of
from torchshard._hlo.matmuls import Matmul, matmuls_of
from torchshard._trainer.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    """Every collective of a compiled program, with counts and bytes per kind and mesh axes.

    ``str(stats)`` is a table: kind, axes, count and bytes per device, then how often a step runs
    them and the bytes per step (loop trip counts applied).

    Attributes:
        ops: the collective instructions, in program order.
        mesh: the mesh their axes are named on, if known.
        runs: how often one step runs each op (a ``while`` body's ops its trip count, nested loops
            multiplied; 0 in a conditional branch other than the heaviest); None: once each.
    """

    ops: tuple[Collective, ...]
    mesh: Mesh | None = None
    runs: tuple[int, ...] | None = None

    def _select(self, kind: str | None, axes: str | Sequence[str] | None) -> Iterator[Collective]:
        return (op for op, _ in self._select_runs(kind, axes))

    def _select_runs(self, kind: str | None, axes: str | Sequence[str] | None) -> Iterator[tuple[Collective, int]]:
        want = None if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        for op, n in zip(self.ops, self.runs or (1,) * len(self.ops), strict=True):
            if kind not in (None, op.kind):
                continue
            if want is None or (op.axes is not None and set(op.axes) == set(want)):
                yield op, n

    def count(self, kind: str | None = None, *, axes: str | Sequence[str] | None = None) -> int:
        """How many collectives of ``kind`` (all kinds if None) over exactly ``axes`` (any if None)."""
        _check_kind(kind)
        return sum(1 for _ in self._select(kind, axes))

    def nbytes(self, kind: str | None = None, *, axes: str | Sequence[str] | None = None) -> int:
        """Result bytes per device of the collectives `count` counts."""
        _check_kind(kind)
        return sum(op.bytes for op in self._select(kind, axes))

    def step_bytes(self, kind: str | None = None, *, axes: str | Sequence[str] | None = None) -> int:
        """Result bytes per device that one step moves through the collectives `count` counts, each
        as often as the step runs it (loop trip counts applied): what a pipeline's loop repeats shows here."""
        _check_kind(kind)
        return sum(op.bytes * n for op, n in self._select_runs(kind, axes))

    @property
    def per_axes(self) -> dict[str, int]:
        """Mesh axes (``Collective.over``) → result bytes per device per step, every kind together."""
        found: dict[str, int] = {}
        for op, n in self._select_runs(None, None):
            found[op.over] = found.get(op.over, 0) + op.bytes * n
        return found

    @property
    def counts(self) -> dict[str, int]:
        """Kind → number of instructions, every kind of `KINDS` present (0 if absent)."""
        return {k: self.count(k) for k in KINDS}

    @property
    def bytes(self) -> dict[str, int]:
        """Kind → result bytes per device, every kind of `KINDS` present."""
        return {k: self.nbytes(k) for k in KINDS}

    def table(self) -> str:
        """One row per (kind, axes): count and bytes per device, runs and bytes per step, then the totals."""
        rows: dict[tuple[str, str], list[tuple[Collective, int]]] = {}
        for op, n in sorted(self._select_runs(None, None), key=lambda o: KINDS.index(o[0].kind)):
            rows.setdefault((op.kind, op.over), []).append((op, n))
        head = ("collective", "over", "count", "bytes/device", "runs/step", "bytes/step")
        body = [
            (
                k,
                over,
                str(len(ops)),
                fmt_bytes(sum(o.bytes for o, _ in ops)),
                str(sum(n for _, n in ops)),
                fmt_bytes(sum(o.bytes * n for o, n in ops)),
            )
            for (k, over), ops in rows.items()
        ]
        where = f" on {describe_mesh(self.mesh)}" if self.mesh is not None else ""
        foot = (
            f"{len(self.ops)} collective(s){where}, {fmt_bytes(self.nbytes())} per device, "
            f"{fmt_bytes(self.step_bytes())} per step"
        )
        return table(head, body, foot)

    def __str__(self) -> str:
        return self.table()


def _check_kind(kind: str | None) -> None:
    if kind is not None and kind not in KINDS:
        raise ShardingError(f"unknown collective kind {kind!r}; use one of {list(KINDS)} or None for all")


def _mesh_of(args: Any) -> Mesh | None:
    leaves = jax.tree.leaves(args, is_leaf=lambda x: hasattr(x, "jax"))
    for leaf in leaves:
        sharding = getattr(unwrap(leaf), "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def unreadable(function: str, target: Any, accepted: str) -> ArgumentError:
    """The error of ``function`` (a `torchshard.inspect` one) given a ``target`` it cannot read: what it got, what
    to pass (``accepted``), and for a torch module how to get a Trainer of it.

    Examples:
        >>> print(unreadable("matmuls", torch.nn.Linear(2, 2), "a torchshard.Trainer and a batch"))
        matmuls() cannot read Linear (a torch module: build a torchshard.Trainer on it first); pass a ...
    """
    got = type(target).__name__
    if isinstance(target, torch.nn.Module):
        got += " (a torch module: build a torchshard.Trainer on it first)"
    elif isinstance(target, str):
        got += f" {target[:30]!r}"
    return ArgumentError(f"{function}() cannot read {got}; pass {accepted}")


def _hlo_text(target: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], mesh: Mesh | None) -> str:
    if isinstance(target, Trainer):
        if len(args) != 1 or kwargs:
            raise ArgumentError("collectives(trainer, batch): pass exactly one batch, as for trainer.step(batch)")
        target = target.lower(args[0])
    elif hasattr(target, "lower") and callable(target):
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            target = target.lower(*args, **kwargs)
    if isinstance(target, jax.stages.Lowered):
        target = target.compile()
    if isinstance(target, jax.stages.Compiled):
        return str(target.as_text())
    if isinstance(target, str):
        return target
    raise unreadable(
        "collectives",
        target,
        "a torchshard.Trainer and a batch, a jax.jit function and its arguments, a jax Lowered/Compiled stage, "
        "or HLO text",
    )


def collectives(target: Any, *args: Any, mesh: Mesh | None = None, **kwargs: Any) -> CollectiveStats:
    """Compiles ``target`` and lists the collectives in its partitioned HLO, per kind and mesh axes.

    Nothing runs and nothing is donated. Bytes are each collective's result size on one
    device (a combined all-reduce counts once, with the bytes of all its operands); `step_bytes`
    and `per_axes` count each as often as a step runs it (loop trip counts applied).

    Args:
        target: a `Trainer` (then ``args`` is one batch), a ``jax.jit`` function (then ``args``
            and ``kwargs`` are its arguments), a ``jax.stages.Lowered`` / ``Compiled``, or HLO text.
        mesh: names the device groups by mesh axes; defaults to the trainer's mesh, or the mesh of
            the first ``NamedSharding`` argument.

    Returns:
        A `CollectiveStats`; ``str()`` of it is a table.

    Raises:
        ArgumentError: ``target`` is none of the above (a torch module, say), or a Trainer with no batch or more.

    Examples:
        >>> mesh = ts.make_mesh({"data": 4, "model": 2})
        >>> x = jax.device_put(np.ones((8, 4), np.float32), jax.sharding.NamedSharding(mesh, P("data")))
        >>> stats = collectives(jax.jit(lambda x: x.sum()), x)
        >>> stats.count("all-gather"), stats.count("all-reduce", axes="data")
        (0, 1)
    """
    if mesh is None:
        mesh = target.mesh if isinstance(target, Trainer) else _mesh_of((args, kwargs))
    counted = collective_runs(_hlo_text(target, args, kwargs, mesh))
    ops = tuple(op for op, _ in counted)
    if mesh is not None:
        ops = tuple(dataclasses.replace(op, axes=axes_of(op, mesh)) for op in ops)
    return CollectiveStats(ops, mesh, tuple(n for _, n in counted))


def matmuls(trainer: Trainer, batch: Any) -> tuple[Matmul, ...]:
    """Every matmul of ``trainer``'s step for ``batch``, with its operands' dtypes and name scopes.

    Read from the traced program, before XLA: on the CPU, XLA converts bf16 matmuls to float32 when
    it compiles, so the compiled HLO cannot say which the step asks for in float32. Nothing runs.

    Args:
        trainer: a `Trainer` (or an `AbstractTrainer`).
        batch: as for ``trainer.step`` (shapes alone for an `AbstractTrainer`).

    Returns:
        One `Matmul` per matmul of the step, in program order.

    Raises:
        ArgumentError: ``trainer`` is no Trainer (a torch module or HLO text, say).

    Examples:
        >>> model = torch.nn.Linear(16, 4)
        >>> p = ts.plan(model, ts.make_mesh({"data": 8}))
        >>> trainer = ts.Trainer(model, lambda m, b: m(b).float().square().mean(), __import__("optax").sgd(0.1), p,
        ...                      precision=ts.MixedPrecision())
        >>> sorted({(m.lhs, m.rhs) for m in matmuls(trainer, torch.randn(32, 16))})
        [('bfloat16', 'bfloat16')]
    """
    if not isinstance(trainer, Trainer):
        raise unreadable("matmuls", trainer, "a torchshard.Trainer (or AbstractTrainer) and a batch")
    return matmuls_of(trainer.trace(batch).jaxpr)
