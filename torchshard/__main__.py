"""``python -m torchshard plan``: dry-run a sharding plan on the meta device and report per-device memory."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import json
import math
import os
import runpy
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import torchshard as ts
from torchshard import presets
from torchshard._plan import _fmt_bytes
from torchshard._visualize import replicated_over

EXIT_OK, EXIT_INVALID_PLAN, EXIT_USAGE = 0, 1, 2

# Module names that Megatron-style TP splits by output (colwise) or by input (rowwise), in common model code.
TP_COLWISE = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "c_attn", "c_fc", "fc1", "w1", "w3")
TP_ROWWISE = ("o_proj", "out_proj", "down_proj", "c_proj", "fc2", "w2")
PRESETS = ("fsdp", "tp", "fsdp+tp", "hf")


class UsageError(Exception):
    """A command-line mistake (exit 2), as opposed to an invalid plan (exit 1)."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=8,model=8"`` → ``{"data": 8, "model": 8}`` (order kept; ``-1`` allowed)."""
    axes: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().lstrip("-").isdigit() or name.strip() in axes:
            raise UsageError(f"--mesh {text!r}: write axis=size pairs with distinct names, e.g. data=8,model=8")
        axes[name.strip()] = int(size)
    if not axes:
        raise UsageError("--mesh is empty; write e.g. data=8,model=8")
    return axes


def load_factory(target: str) -> Callable[[], torch.nn.Module]:
    """``pkg.module:build`` or ``path/to/file.py:build`` (dots after the colon walk attributes)."""
    where, sep, attr = target.partition(":")
    if not sep or not where or not attr:
        raise UsageError(f"{target!r}: write MODULE:FACTORY, e.g. mypkg.models:build or models.py:MLP")
    try:
        namespace: Any = runpy.run_path(where) if where.endswith(".py") else importlib.import_module(where)
    except (ImportError, OSError) as err:
        raise UsageError(f"cannot import {where!r}: {err}") from err
    obj = namespace
    for part in attr.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
        if obj is None:
            raise UsageError(f"{where!r} has no attribute {attr!r}")
    return obj


def build_on_meta(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Runs the factory under ``torch.device("meta")``: shapes and dtypes, no parameter memory."""
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_mesh(axes: dict[str, int]) -> tuple[Any, bool]:
    """A device mesh when the local devices suffice; otherwise an AbstractMesh (planning needs no devices)."""
    import jax
    from jax.sharding import AbstractMesh, AxisType

    size = math.prod(axes.values())
    if -1 in axes.values() or 0 < size <= jax.device_count():
        devices = None if -1 in axes.values() else jax.devices()[:size]
        return ts.make_mesh(axes, devices=devices), False
    bad = [f"{name}={n}" for name, n in axes.items() if n < 1]
    if bad:
        raise ts.ShardingError(f"mesh {axes}: sizes must be positive, got {', '.join(bad)}")
    return AbstractMesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes)), True


def load_rules(path: str) -> ts.Rules:
    """Runs a rules file and returns its ``RULES`` (a `Rules` or a list of ``(pattern, spec)`` pairs)."""
    try:
        namespace = runpy.run_path(path)
    except OSError as err:
        raise UsageError(f"--rules {path!r}: {err}") from err
    if "RULES" not in namespace:
        raise UsageError(f"--rules {path!r} defines no RULES; add RULES = [(r'pattern', ('data', None)), ...]")
    rules = namespace["RULES"]
    return rules if isinstance(rules, ts.Rules) else ts.Rules(rules)


def _hf_tp_plan(model: torch.nn.Module) -> dict[str, str] | None:
    return getattr(getattr(model, "config", None), "base_model_tp_plan", None) or None


def tp_rules(model: torch.nn.Module, axis: str) -> ts.Rules:
    """The model's HF ``base_model_tp_plan`` if it has one, else the common projection names above."""
    hf = _hf_tp_plan(model)
    if hf:
        return presets.from_hf_tp_plan(hf, axis=axis)
    names = lambda group: [r"(?:.*\.)?(?:" + "|".join(group) + ")"]  # noqa: E731
    return presets.tensor_parallel(colwise=names(TP_COLWISE), rowwise=names(TP_ROWWISE), axis=axis)


def preset_rules(name: str, model: torch.nn.Module, mesh: Any, *, fsdp_axis: str, tp_axis: str) -> ts.Rules:
    """Rules for ``--preset``; raises `ShardingError` if the mesh lacks the axis the preset shards over."""
    axes = {"fsdp": [fsdp_axis], "tp": [tp_axis], "fsdp+tp": [tp_axis, fsdp_axis], "hf": [tp_axis]}[name]
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise ts.ShardingError(
            f"--preset {name} shards over {missing}, which mesh {dict(mesh.shape)} lacks; name the mesh axes "
            f"accordingly (--mesh {fsdp_axis}=N,{tp_axis}=M) or pass --fsdp-axis / --tp-axis"
        )
    if name == "hf":
        if not _hf_tp_plan(model):
            raise UsageError(f"--preset hf: {type(model).__name__} has no config.base_model_tp_plan; use --preset tp")
        return presets.from_hf_tp_plan(_hf_tp_plan(model), axis=tp_axis)
    rules = tp_rules(model, tp_axis) if "tp" in name else ts.Rules()
    return rules + presets.fsdp(fsdp_axis) if "fsdp" in name else rules


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device for training with AdamW: params, grads, two moment copies, buffers."""

    params: int
    grads: int
    adamw_state: int
    buffers: int
    unsharded: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.adamw_state + self.buffers

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("params", self.params),
            ("grads", self.grads),
            ("AdamW state (2 copies)", self.adamw_state),
            ("buffers", self.buffers),
            ("total", self.total),
        ]


def memory(plan: ts.ShardingPlan, model: torch.nn.Module) -> Memory:
    """Per-device training memory implied by ``plan`` (activations not included)."""
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    params = plan.bytes_per_device("param")
    grads = sum(e.bytes_per_device for e in plan.unique_entries() if e.kind == "param" and e.name in trainable)
    unsharded_grads = sum(e.total_bytes for e in plan.unique_entries() if e.kind == "param" and e.name in trainable)
    return Memory(params, grads, 2 * grads, plan.bytes_per_device("buffer"), plan.total_bytes() + 3 * unsharded_grads)


def replicated(plan: ts.ShardingPlan, top: int) -> list[dict[str, Any]]:
    """The ``top`` largest tensors (bytes per device) that some mesh axis holds more than one copy of."""
    found = [
        {"name": e.name, "shape": list(e.shape), "spec": str(e.spec), "replicated_over": over,
         "bytes_per_device": e.bytes_per_device}
        for e in plan.unique_entries()
        if (over := replicated_over(e.spec, plan.mesh))
    ]  # fmt: skip
    return sorted(found, key=lambda r: -r["bytes_per_device"])[:top]


def report(model: torch.nn.Module, plan: ts.ShardingPlan, *, abstract: bool, top: int) -> dict[str, Any]:
    """Everything the CLI prints, as JSON-ready data."""
    mem = memory(plan, model)
    return {
        "model": type(model).__name__,
        "mesh": dict(plan.mesh.shape),
        "abstract_mesh": abstract,
        "tensors": plan.rows(),
        "per_device_bytes": {name: n for name, n in mem.rows()},
        "unsharded_bytes": mem.unsharded,
        "largest_replicated": replicated(plan, top),
    }


def _mesh_line(data: dict[str, Any]) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in data["mesh"].items())
    kind = "abstract mesh, larger than the local devices" if data["abstract_mesh"] else "local devices"
    return f"{data['model']} on Mesh({mesh}) ({kind})"


def _replicated_cells(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    return [
        (r["name"], "×".join(map(str, r["shape"])) or "()", ",".join(r["replicated_over"]),
         _fmt_bytes(r["bytes_per_device"]))
        for r in rows
    ]  # fmt: skip


def _aligned(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def format_text(data: dict[str, Any], body: str) -> str:
    """The plan (``body``: its table or compact view), then memory, replicated tensors and the comparison."""
    mem = data["per_device_bytes"]
    share = mem["total"] / max(data["unsharded_bytes"], 1)
    lines = [_mesh_line(data), "", body, "", "training memory per device (AdamW, activations not included):"]
    lines += [f"  {name:<24}{_fmt_bytes(n):>12}" for name, n in mem.items()]
    lines += [f"  ({share:.1%} of {_fmt_bytes(data['unsharded_bytes'])} on one device)", ""]
    cells = _replicated_cells(data["largest_replicated"])
    lines += (
        [f"largest replicated tensors ({len(cells)}):"] if cells else ["no tensor is replicated over any mesh axis"]
    )
    lines += _aligned([("name", "shape", "replicated over", "bytes/device"), *cells]) if cells else []
    if "compare" in data:
        differs = data["compare"]["differs"]
        lines += ["", f"compared with {data['compare']['against']}: {len(differs)} tensor(s) differ"]
        lines += _aligned([("name", "spec here", "spec there"), *((n, *pair) for n, pair in differs.items())])
    return "\n".join(lines)


def format_markdown(data: dict[str, Any], plan: ts.ShardingPlan) -> str:
    head = "| name | shape | dtype | spec | shard/device | bytes/device |\n|---|---|---|---|---|---|"
    body = [
        f"| `{r['name']}` | {'×'.join(map(str, r['shape']))} | {r['dtype']} | `{r['spec']}` | "
        f"{'×'.join(map(str, r['shard_shape']))} | {_fmt_bytes(r['bytes_per_device'])} |"
        for r in data["tensors"]
    ]
    mem = [
        "| per device | bytes |",
        "|---|---|",
        *(f"| {k} | {_fmt_bytes(n)} |" for k, n in data["per_device_bytes"].items()),
    ]
    cells = _replicated_cells(data["largest_replicated"])
    replicated_rows = ["| replicated tensor | shape | over | bytes/device |", "|---|---|---|---|"]
    replicated_rows += [f"| `{name}` | {shape} | {over} | {size} |" for name, shape, over, size in cells]
    lines = [f"**{_mesh_line(data)}**", "", head, *body, "", *mem, "", *(replicated_rows if cells else [])]
    if "compare" in data:
        differs = data["compare"]["differs"]
        lines += ["", f"compared with {data['compare']['against']}: {len(differs)} tensor(s) differ", ""]
        lines += [f"- `{name}`: `{here}` here, `{there}` there" for name, (here, there) in differs.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchshard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="dry-run a sharding plan on the meta device")
    p.add_argument("target", metavar="MODULE:FACTORY", help="e.g. mypkg.models:build or models.py:MLP")
    p.add_argument("--mesh", required=True, help="axis sizes in mesh order, e.g. data=8,model=8")
    p.add_argument("--rules", metavar="FILE.py", help="a Python file defining RULES (tried before --preset's)")
    p.add_argument("--preset", choices=PRESETS, help="fsdp | tp (HF tp plan or common names) | fsdp+tp | hf")
    p.add_argument("--fsdp-axis", default="data", help="mesh axis of the fsdp presets (default: data)")
    p.add_argument("--tp-axis", default="model", help="mesh axis of the tp presets (default: model)")
    p.add_argument("--default", choices=("replicate", "error"), default="replicate", help="unmatched tensors")
    p.add_argument("--compare", metavar="PRESET|FILE.py", help="list the tensors whose spec differs under this")
    p.add_argument("--format", choices=("table", "compact", "json", "markdown"), default="table")
    p.add_argument("--top", type=int, default=5, help="how many replicated tensors to list (default: 5)")
    return parser


def plan_with(
    args: argparse.Namespace, model: torch.nn.Module, mesh: Any, *, rules_file: str | None, preset: str | None
) -> ts.ShardingPlan:
    """Plans ``model`` with a rules file's rows, then a preset's; unused-rule warnings become notes on stderr."""
    rules = load_rules(rules_file) if rules_file else ts.Rules()
    if preset:
        rules = rules + preset_rules(preset, model, mesh, fsdp_axis=args.fsdp_axis, tp_axis=args.tp_axis)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ts.UnusedRuleWarning)
        plan = ts.plan(model, mesh, rules, default=args.default)
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)
    return plan


def compare(args: argparse.Namespace, model: torch.nn.Module, plan: ts.ShardingPlan) -> dict[str, Any]:
    """``--compare PRESET|FILE.py``: the tensors whose spec differs from the plan under that preset or rules file."""
    other = args.compare
    if other not in PRESETS and not other.endswith(".py"):
        raise UsageError(f"--compare {other!r}: give a preset ({', '.join(PRESETS)}) or a rules file ending in .py")
    is_preset = other in PRESETS
    there = plan_with(
        args, model, plan.mesh, rules_file=None if is_preset else other, preset=other if is_preset else None
    )
    differs = {name: [str(a), str(b)] for name, (a, b) in plan.diff(there).items()}
    return {"against": f"--preset {other}" if is_preset else f"--rules {other}", "differs": differs}


def run_plan(args: argparse.Namespace) -> str:
    """Builds, plans and formats; raises `UsageError` or `ShardingError`."""
    model = build_on_meta(load_factory(args.target))
    mesh, abstract = build_mesh(parse_mesh(args.mesh))
    plan = plan_with(args, model, mesh, rules_file=args.rules, preset=args.preset)
    data = report(model, plan, abstract=abstract, top=args.top)
    if args.compare:
        data["compare"] = compare(args, model, plan)
    if args.format == "json":
        return json.dumps(data, indent=2)
    if args.format == "markdown":
        return format_markdown(data, plan)
    return format_text(data, _compact(plan) if args.format == "compact" else plan.table())


def _compact(plan: ts.ShardingPlan) -> str:
    out = io.StringIO()
    ts.visualize_plan(plan, file=out)
    return out.getvalue().rstrip()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 for a valid plan, 1 with the full `ShardingError` for an invalid one, 2 for usage errors."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a dry run must not grab accelerator memory
    args = build_parser().parse_args(argv)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # MODULE:FACTORY names modules of the working directory
    try:
        print(run_plan(args))
    except ts.ShardingError as err:
        print(f"error: invalid sharding plan\n{err}", file=sys.stderr)
        return EXIT_INVALID_PLAN
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
