"""What a compiled step costs per device: matmul FLOPs, memory traffic and collectives, loops counted fully."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

from torchshard._bridge.ops.flash import RECOMPUTE_SCOPE, TILE_SCOPE
from torchshard._hlo.hlo import Collective, array_bytes, array_dims, parse_hlo

_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\((?P<params>.*)\)\s*->.*\{\s*$")
_PARAM = re.compile(r"(?P<name>[\w.\-]+):\s*(?P<type>[a-z]\w*\[[\d,]*\])")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+(?P<op>[\w\-]+)\((?P<args>[^)]*)\)"
)
_CALLED = re.compile(
    r"\b(?P<how>body|condition|calls|to_apply|branch_computations)=\{?(?P<names>%[\w.\-]+(?:,\s*%[\w.\-]+)*)"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COMMENT = re.compile(r"/\*.*?\*/")  # /*index=5*/ between operands
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
# name scopes of recomputed forwards: jax.checkpoint's (remat=), and the tiled attention's backward scores
RECOMPUTED = frozenset({"rematted_computation", RECOMPUTE_SCOPE})
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
                   "after-all", "partition-id", "replica-id", "opt-barrier"})  # fmt: skip
# computations run as part of their caller's instruction: their insides move no memory of their own
_INLINED = frozenset({"calls", "to_apply"})


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Per-device work of one compiled program, every loop body counted as often as it runs.

    Attributes:
        flops: floating-point operations of its matmuls (``dot``: 2 × output elements × contracted size).
        bytes_accessed: bytes its top-level instructions (fusions, matmuls, copies, collectives) read and write.
        collectives: each collective with how often it runs (a loop's repeated; fractional once
            extrapolated in depth), with mesh axes once known.
        tile_bytes: bytes the attention kernels' tiles (``TILE_SCOPE``) pass between their own
            instructions: XLA writes them to memory, a fused flash kernel keeps them on chip; not
            in ``bytes_accessed``, which has only what crosses a tile's boundary.
        recompute_flops: the part of ``flops`` that recomputes forward work in the backward: a
            checkpointed module's forward (JAX's ``rematted_computation`` scope) and the tiled
            attention's scores (``RECOMPUTE_SCOPE``); ``flops - recompute_flops`` is the step as if
            nothing were rematerialised, the model FLOPs MFU is measured with.
    """

    flops: float
    bytes_accessed: float
    collectives: tuple[tuple[Collective, float], ...]
    tile_bytes: float = 0.0
    recompute_flops: float = 0.0

    @property
    def model_flops(self) -> float:
        """``flops`` with rematerialised matmuls counted once (what MFU divides by the peak)."""
        return self.flops - self.recompute_flops

    def scaled(self, other: StepCosts, factor: float) -> StepCosts:
        """``self + factor * (other - self)``: a cost at another depth, from two compiled depths."""
        mix = lambda a, b: a + factor * (b - a)  # noqa: E731
        return StepCosts(
            mix(self.flops, other.flops),
            mix(self.bytes_accessed, other.bytes_accessed),
            _mix_collectives(self.collectives, other.collectives, factor),
            mix(self.tile_bytes, other.tile_bytes),
            mix(self.recompute_flops, other.recompute_flops),
        )


def _mix_collectives(
    a: tuple[tuple[Collective, float], ...], b: tuple[tuple[Collective, float], ...], factor: float
) -> tuple[tuple[Collective, float], ...]:
    """Each (kind, axes) group's bytes extrapolated, carried by ``b``'s ops with their counts scaled.

    Grouping by kind and axes, not by shapes: XLA combines a depth's small collectives into tuples
    whose shapes change with the depth, so a combined op of 2 layers seen at depth 2 only would
    otherwise scale from zero as if it were one layer's (on a tiny Llama: +16% bytes at 4 layers).
    """
    totals: dict[tuple[str, tuple[str, ...] | None], list[float]] = {}
    for which, ops in enumerate((a, b)):
        for op, n in ops:
            totals.setdefault((op.kind, op.axes), [0.0, 0.0])[which] += n * op.bytes
    scale = {key: (b1 + factor * (b2 - b1)) / b2 for key, (b1, b2) in totals.items() if b2 > 0}
    return tuple((op, n * scale[key]) for op, n in b if scale.get(key := (op.kind, op.axes), 0.0) > 0)


@dataclasses.dataclass
class _Computation:
    name: str
    lines: list[str]
    types: dict[str, str]


def _computations(text: str) -> Iterator[tuple[_Computation, bool]]:
    current: _Computation | None = None
    entry = False
    for line in text.splitlines():
        if current is None:
            if m := _HEADER.match(line):
                types = {p.group("name"): p.group("type") for p in _PARAM.finditer(m.group("params"))}
                current, entry = _Computation(m.group("name"), [], types), bool(m.group("entry"))
        elif line.startswith("}"):
            yield current, entry
            current = None
        else:
            current.lines.append(line)
            if m := _INSTRUCTION.match(line):
                current.types[m.group("name")] = m.group("type")


def _multipliers(comps: dict[str, _Computation], entry: str) -> tuple[dict[str, int], set[str]]:
    """How often each computation runs per step, and which ones are inlined into an instruction.

    A ``conditional`` runs one of its branches: only the heaviest (`_weight`) is counted, so a
    tile-skip ``lax.cond`` (compute the tile, or pass it by) costs one tile, not both branches.
    """
    runs, inlined, todo = {entry: 1}, set(), [entry]
    weights: dict[str, tuple[float, int]] = {}
    while todo:
        name = todo.pop()
        for line in comps[name].lines:
            trip = int(t.group(1)) if (t := _TRIP.search(line)) else 1
            for call in _CALLED.finditer(line):
                callees = re.findall(r"%([\w.\-]+)", call.group("names"))
                if call.group("how") == "branch_computations" and len(callees) > 1:
                    callees = [max(callees, key=lambda c: _weight(comps, c, weights))]
                for callee in callees:
                    n = runs[name] * (trip if call.group("how") in ("body", "condition") else 1)
                    if call.group("how") in _INLINED:
                        inlined.add(callee)
                    if callee in comps and runs.get(callee, 0) < n:
                        runs[callee] = n
                        todo.append(callee)
    return runs, inlined


def _weight(comps: dict[str, _Computation], name: str, memo: dict[str, tuple[float, int]]) -> tuple[float, int]:
    """How heavy one run of computation ``name`` is: (matmul FLOPs, instructions), what it calls included."""
    if name in memo:
        return memo[name]
    memo[name] = (0.0, 0)  # a cycle (none in valid HLO) weighs nothing
    comp, flops, count = comps.get(name), 0.0, 0
    for line in comp.lines if comp is not None else ():
        if not (m := _INSTRUCTION.match(line)):
            continue
        count += 1
        flops += _dot_flops(line, m.group("op"), m.group("args"), m.group("type"), comp.types) if comp else 0.0
        trip = int(t.group(1)) if (t := _TRIP.search(line)) else 1
        for call in _CALLED.finditer(line):
            inner = [_weight(comps, c, memo) for c in re.findall(r"%([\w.\-]+)", call.group("names"))]
            if call.group("how") == "branch_computations" and inner:
                inner = [max(inner)]
            n = trip if call.group("how") in ("body", "condition") else 1
            flops, count = flops + n * sum(f for f, _ in inner), count + n * sum(c for _, c in inner)
    memo[name] = (flops, count)
    return memo[name]


def _dot_flops(line: str, op: str, args: str, result: str, types: dict[str, str]) -> float:
    if op != "dot":
        return 0.0
    lhs = types.get(args.split(",")[0].strip().lstrip("%"), "")
    contracting = _CONTRACTING.search(line)
    dims = array_dims(lhs)
    size = math.prod(dims[int(i)] for i in contracting.group(1).split(",") if i) if contracting and dims else 1
    return 2.0 * math.prod(array_dims(result)) * size


def step_costs(text: str) -> StepCosts:
    """Matmul FLOPs, bytes accessed and collectives of a compiled module's HLO text, loops unrolled by count.

    XLA's own ``cost_analysis()`` counts a ``while`` body once whatever its trip count, so a
    scanned stack of 32 layers would cost one layer; here each computation is weighted by how
    often it runs (the ``known_trip_count`` XLA annotates on loops, nested loops multiplied).

    Examples:
        >>> import jax
        >>> f = lambda x, w: jax.lax.scan(lambda c, wi: (c @ wi, None), x, w)[0]
        >>> x, w = jax.ShapeDtypeStruct((8, 16), np.float32), jax.ShapeDtypeStruct((4, 16, 16), np.float32)
        >>> step_costs(jax.jit(f).lower(x, w).compile().as_text()).flops == 4 * 2 * 8 * 16 * 16
        True
    """
    parsed = list(_computations(text))
    comps = {c.name: c for c, _ in parsed}
    entry = next(c.name for c, is_entry in parsed if is_entry)
    runs, inlined = _multipliers(comps, entry)
    callers = _caller_names(comps)
    flops = recompute = traffic = on_chip = 0.0
    for name, n in runs.items():
        comp = comps[name]
        for line in comp.lines:
            if (m := _INSTRUCTION.match(line)) and m.group("op") == "dot":
                dot = n * _dot_flops(line, m.group("op"), m.group("args"), m.group("type"), comp.types)
                op_name = m_.group(1) if (m_ := _OP_NAME.search(line)) else callers.get(name, "")
                flops, recompute = flops + dot, recompute + (dot if _recomputed(op_name) else 0.0)
        if name not in inlined:
            moved, kept = _traffic(comps, comp)
            traffic, on_chip = traffic + n * moved, on_chip + n * kept
    return StepCosts(flops, traffic, _collectives(text, comps, runs), on_chip, recompute)


def _caller_names(comps: dict[str, _Computation]) -> dict[str, str]:
    """Computation → the op_name of the instruction that calls it (a fused dot has no metadata of its own).

    A fusion XLA made without metadata (XLA:CPU's matmul fusions) is named by its first user that has one.
    """
    found: dict[str, str] = {}
    for comp in comps.values():
        parsed = [(m, line) for line in comp.lines if (m := _INSTRUCTION.match(line))]
        users: dict[str, str] = {}
        for m, line in parsed:
            if op_name := _OP_NAME.search(line):
                for operand in _operands(m.group("args")):
                    users.setdefault(operand, op_name.group(1))
        for m, line in parsed:
            if called := _CALLED.search(line):
                own = _OP_NAME.search(line)
                name = own.group(1) if own else users.get(m.group("name"), "")
                for callee in re.findall(r"%([\w.\-]+)", called.group("names")):
                    found.setdefault(callee, name)
    return found


def _recomputed(op_name: str) -> bool:
    return not RECOMPUTED.isdisjoint(op_name.split("/"))


def _traffic(comps: dict[str, _Computation], comp: _Computation) -> tuple[int, int]:
    """Bytes ``comp``'s instructions move through memory, and those its attention tiles pass among themselves."""
    parsed = [(m, line) for line in comp.lines if (m := _INSTRUCTION.match(line))]
    tile: set[str] = set()
    for m, line in parsed:  # in order: an instruction XLA added without a name (a copy) joins the tile it reads
        named = _OP_NAME.search(line) is not None
        if _in_tile(comps, line) or (not named and any(o in tile for o in _operands(m.group("args")))):
            tile.add(m.group("name"))
    outside = {o for m, line in parsed if m.group("name") not in tile for o in _operands(m.group("args"))}
    outside |= {m.group("name") for m, line in parsed if line.lstrip().startswith("ROOT")}
    moved = kept = 0
    for m, line in parsed:
        op, name, operands = m.group("op"), m.group("name"), _operands(m.group("args"))
        if op in _FREE or op.endswith("-done"):
            continue
        reads, written = _moved(comps, comp, line, op, operands, m.group("type"))
        if name not in tile:
            moved += sum(reads) + written
            continue
        crossing = sum(r for r, o in zip(reads, operands, strict=False) if o not in tile)
        crossing += written if name in outside else 0
        moved, kept = moved + crossing, kept + sum(reads) + written - crossing
    return moved, kept


def _in_tile(comps: dict[str, _Computation], line: str) -> bool:
    """Whether an instruction (or, for a fusion, any instruction it fuses) is named in an attention tile's scope."""
    m = _OP_NAME.search(line)
    if m is not None and TILE_SCOPE in m.group(1).split("/"):
        return True
    called = _CALLED.search(line) if " fusion(" in line else None
    fused = comps.get(called.group("names").split(",")[0].strip().lstrip("%")) if called else None
    return fused is not None and any(_in_tile(comps, inner) for inner in fused.lines if "op_name=" in inner)


def _operands(args: str) -> list[str]:
    return [a.strip().lstrip("%") for a in _COMMENT.sub("", args).split(",") if a.strip()]


def _moved(
    comps: dict[str, _Computation], comp: _Computation, line: str, op: str, operands: list[str], result: str
) -> tuple[list[int], int]:
    """Bytes a top-level instruction reads (per operand) and writes; a dynamic slice moves its slice.

    As XLA's own cost analysis counts them: a ``dynamic-slice`` reads and writes its result, a
    ``dynamic-update-slice`` its update (in place), and a fusion reads of an operand only what its
    dynamic slices take and writes of an in-place updated output only the update. Loops that walk
    a stacked array (a scan's layers, an attention's tiles) would otherwise move the whole array
    at every step.
    """
    types = [comp.types.get(o, "") for o in operands]
    if op == "dynamic-slice":
        return [array_bytes(result)] + [0] * (len(types) - 1), array_bytes(result)
    if op == "dynamic-update-slice":
        update = array_bytes(types[1])
        return [0, update] + [0] * (len(types) - 2), update
    called = _CALLED.search(line) if op == "fusion" else None
    fused = comps.get(called.group("names").split(",")[0].strip().lstrip("%")) if called else None
    if fused is None:
        return [array_bytes(t) for t in types], array_bytes(result)
    return _fusion_moved(fused, types, result)


def _fusion_moved(fused: _Computation, operand_types: list[str], result: str) -> tuple[list[int], int]:
    instructions = [
        (m.group("name"), m.group("op"), _operands(m.group("args")), line.lstrip().startswith("ROOT"))
        for line in fused.lines
        if (m := _INSTRUCTION.match(line))
    ]
    uses: dict[str, list[tuple[str, int, str]]] = {}
    for name, op, operands, _ in instructions:
        for position, operand in enumerate(operands):
            uses.setdefault(operand, []).append((op, position, name))
    reads = [array_bytes(t) for t in operand_types]
    for name, op, operands, _ in instructions:
        if op != "parameter" or not operands[0].isdigit() or int(operands[0]) >= len(operand_types):
            continue
        users = uses.get(name, [])
        sliced = [user for kind, pos, user in users if kind == "dynamic-slice" and pos == 0]
        in_place = [user for kind, pos, user in users if kind == "dynamic-update-slice" and pos == 0]
        if users and len(sliced) + len(in_place) == len(users):
            reads[int(operands[0])] = sum(array_bytes(fused.types[u]) for u in sliced)
    return reads, _written(instructions, fused.types, result)


def _written(instructions: list[tuple[str, str, list[str], bool]], types: dict[str, str], result: str) -> int:
    """Bytes a fusion writes: each in-place updated output only its update."""
    by_name = {name: (op, operands) for name, op, operands, _ in instructions}
    root = next((name for name, _, _, is_root in instructions if is_root), None)
    if root is None:
        return array_bytes(result)
    op, operands = by_name[root]
    outputs = operands if op == "tuple" else [root]
    total = 0
    for out in outputs:
        kind, args = by_name.get(out, ("", []))
        total += array_bytes(types.get(args[1], "") if kind == "dynamic-update-slice" else types.get(out, ""))
    return total


def collective_runs(text: str) -> tuple[tuple[Collective, int], ...]:
    """Each collective of a compiled module's HLO text with how often one step runs it (loop trip counts applied).

    A collective inside a ``while`` body with a known trip count runs that many times (nested loops
    multiply); one in a conditional branch other than the heaviest runs zero times (see `step_costs`).

    Examples:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> add = jax.shard_map(lambda x: x + jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
        >>> f = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda _, x: add(x), x))
        >>> [(op.kind, op.bytes, n) for op, n in collective_runs(f.lower(np.ones(16, np.float32)).compile().as_text())]
        [('all-reduce', 8, 3)]
    """
    parsed = list(_computations(text))
    comps = {c.name: c for c, _ in parsed}
    entry = next(c.name for c, is_entry in parsed if is_entry)
    runs, _ = _multipliers(comps, entry)
    return _collectives(text, comps, runs)


def _collectives(text: str, comps: dict[str, _Computation], runs: dict[str, int]) -> tuple[tuple[Collective, int], ...]:
    where = {m.group("name"): name for name, c in comps.items() for line in c.lines if (m := _INSTRUCTION.match(line))}
    # a collective of a computation no step runs (a lighter conditional branch) runs 0 times; an unparsed one, once
    return tuple((op, runs.get(where[op.name], 0) if op.name in where else 1) for op in parse_hlo(text))
