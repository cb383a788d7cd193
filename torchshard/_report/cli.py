"""The plan dry-run behind ``python -m torchshard plan``: build on meta, plan, report memory, format."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import math
import runpy
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchshard._base.errors import ArgumentError, ShardingError, UnusedRuleWarning
from torchshard._base.format import columns, fmt_bytes, fmt_shape
from torchshard._presets.hf import hf_rules
from torchshard._presets.hf_plan import from_hf_tp_plan
from torchshard._presets.tables import common_tensor_parallel, fsdp
from torchshard._report.fit import (
    compile_only,
    compile_report,
    compiled_lines,
    devices_for,
    parse_size,
    strategy_options,
    verdict,
)
from torchshard._report.memory import training_memory
from torchshard._report.usage import UsageError
from torchshard._report.visualize import replicated_over, visualize_plan
from torchshard._sharding.mesh import make_mesh, parse_axes
from torchshard._sharding.plan import ShardingPlan, plan
from torchshard._sharding.rules import Rules
from torchshard._train.precision import master_dtype

PRESET_HELP = {
    "fsdp": "presets.fsdp(FSDP_AXIS): every tensor of >= 4096 elements split along its largest dim that the axis "
    "divides; the rest replicated",
    "tp": "tensor parallelism over TP_AXIS: the model's config.base_model_tp_plan (presets.from_hf_tp_plan) if it has "
    "one, else presets.common_tensor_parallel (q/k/v/qkv/gate/up_proj, c_attn, c_fc, fc1, w1, w3 column-wise; "
    "o/out/down_proj, c_proj, fc2, w2 row-wise)",
    "fsdp+tp": "tp, then fsdp on another dim of each tensor",
    "hf": "presets.hf_rules(model, axis=TP_AXIS, fsdp_axis=FSDP_AXIS), as in Python: a transformers model's own "
    "tp_plan (lm_head included) checked against its head counts, + fsdp, with the vocabulary dim of the embedding and "
    "head over FSDP_AXIS",
}
PRESETS = tuple(PRESET_HELP)


def parse_mesh(text: str) -> dict[str, int]:
    """``--mesh``: ``"data=8,model=8"`` → ``{"data": 8, "model": 8}`` (order kept; ``-1`` allowed), as `parse_axes`."""
    try:
        return parse_axes(text)
    except ArgumentError as err:
        raise UsageError(f"--mesh {text!r}: {err}") from None


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
        return make_mesh(axes, devices=devices), False
    return AbstractMesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes)), True


def load_rules(path: str) -> Rules:
    """Runs a rules file and returns its ``RULES`` (a `Rules` or a list of ``(pattern, spec)`` pairs)."""
    try:
        namespace = runpy.run_path(path)
    except OSError as err:
        raise UsageError(f"--rules {path!r}: {err}") from err
    if "RULES" not in namespace:
        raise UsageError(f"--rules {path!r} defines no RULES; add RULES = [(r'pattern', ('data', None)), ...]")
    rules = namespace["RULES"]
    return rules if isinstance(rules, Rules) else Rules(rules)


def _hf_tp_plan(model: torch.nn.Module) -> dict[str, str] | None:
    return getattr(getattr(model, "config", None), "base_model_tp_plan", None) or None


def tp_rules(model: torch.nn.Module, axis: str) -> Rules:
    """The model's HF ``base_model_tp_plan`` if it has one, else the common projection names above."""
    hf = _hf_tp_plan(model)
    if hf:
        return from_hf_tp_plan(hf, axis=axis)
    return common_tensor_parallel(axis=axis)


def preset_rules(name: str, model: torch.nn.Module, mesh: Any, *, fsdp_axis: str, tp_axis: str) -> Rules:
    """Rules for ``--preset``; raises `ShardingError` if the mesh lacks the axis the preset shards over."""
    axes = {"fsdp": [fsdp_axis], "tp": [tp_axis], "fsdp+tp": [tp_axis, fsdp_axis], "hf": [tp_axis, fsdp_axis]}[name]
    if name == "hf" and getattr(model, "config", None) is None:
        raise UsageError(f"--preset hf: {type(model).__name__} is not a transformers model (no .config); use fsdp+tp")
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise ShardingError(
            f"--preset {name} shards over {missing}, which mesh {dict(mesh.shape)} lacks; name the mesh axes "
            f"accordingly (--mesh {fsdp_axis}=N,{tp_axis}=M) or pass --fsdp-axis / --tp-axis"
        )
    if name == "hf":
        return hf_rules(model, axis=tp_axis, fsdp_axis=fsdp_axis)
    rules = tp_rules(model, tp_axis) if "tp" in name else Rules()
    return rules + fsdp(fsdp_axis) if "fsdp" in name else rules


def replicated(plan: ShardingPlan, top: int) -> list[dict[str, Any]]:
    """The ``top`` largest tensors (bytes per device) that some mesh axis holds more than one copy of."""
    found: list[dict[str, Any]] = [
        {
            "name": e.name,
            "shape": list(e.shape),
            "spec": str(e.spec),
            "replicated_over": over,
            "bytes_per_device": e.bytes_per_device,
        }
        for e in plan.unique_entries()
        if (over := replicated_over(e.spec, plan.mesh))
    ]
    return sorted(found, key=lambda r: -r["bytes_per_device"])[:top]


def report(
    model: torch.nn.Module, plan: ShardingPlan, *, abstract: bool, top: int, param_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Everything the CLI prints, as JSON-ready data (``param_dtype``: a MixedPrecision's storage dtype)."""
    mem = training_memory(plan, model, param_dtype=param_dtype)
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
    if "simulated_devices" in data:
        kind = f"{data['simulated_devices']} simulated CPU devices"
    return f"{data['model']} on Mesh({mesh}) ({kind})"


def _what_counts(data: dict[str, Any]) -> str:
    precision = data.get("compile", {}).get("precision", "fp32")
    master = ", fp32 master weights" if master_dtype(precision) is not None else ""
    return f"AdamW{master}, activations not included"


def _replicated_cells(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    return [
        (r["name"], fmt_shape(r["shape"]), ",".join(r["replicated_over"]), fmt_bytes(r["bytes_per_device"]))
        for r in rows
    ]


def format_text(data: dict[str, Any], body: str) -> str:
    """The plan (``body``: its table or compact view), then memory, replicated tensors and the comparison."""
    mem = data["per_device_bytes"]
    share = mem["total"] / max(data["unsharded_bytes"], 1)
    lines = [_mesh_line(data), "", body, "", f"training memory per device ({_what_counts(data)}):"]
    lines += [f"  {name:<24}{fmt_bytes(n):>12}" for name, n in mem.items()]
    lines += [f"  ({share:.1%} of {fmt_bytes(data['unsharded_bytes'])} on one device)", ""]
    cells = _replicated_cells(data["largest_replicated"])
    lines += (
        [f"largest replicated tensors ({len(cells)}):"] if cells else ["no tensor is replicated over any mesh axis"]
    )
    lines += columns([("name", "shape", "replicated over", "bytes/device"), *cells], indent="  ") if cells else []
    if "compare" in data:
        differs = data["compare"]["differs"]
        lines += ["", f"compared with {data['compare']['against']}: {len(differs)} tensor(s) differ"]
        rows = [("name", "spec here", "spec there"), *((n, *pair) for n, pair in differs.items())]
        lines += columns(rows, indent="  ")
    if "compiled" in data:
        lines += ["", *compiled_lines(data)]
    return "\n".join(lines)


def format_markdown(data: dict[str, Any], plan: ShardingPlan) -> str:
    head = "| name | shape | dtype | spec | shard/device | bytes/device |\n|---|---|---|---|---|---|"
    body = [
        f"| `{r['name']}` | {'×'.join(map(str, r['shape']))} | {r['dtype']} | `{r['spec']}` | "
        f"{'×'.join(map(str, r['shard_shape']))} | {fmt_bytes(r['bytes_per_device'])} |"
        for r in data["tensors"]
    ]
    mem = [
        "| per device | bytes |",
        "|---|---|",
        *(f"| {k} | {fmt_bytes(n)} |" for k, n in data["per_device_bytes"].items()),
    ]
    cells = _replicated_cells(data["largest_replicated"])
    replicated_rows = ["| replicated tensor | shape | over | bytes/device |", "|---|---|---|---|"]
    replicated_rows += [f"| `{name}` | {shape} | {over} | {size} |" for name, shape, over, size in cells]
    lines = [f"**{_mesh_line(data)}**", "", head, *body, "", *mem, "", *(replicated_rows if cells else [])]
    if "compare" in data:
        differs = data["compare"]["differs"]
        lines += ["", f"compared with {data['compare']['against']}: {len(differs)} tensor(s) differ", ""]
        lines += [f"- `{name}`: `{here}` here, `{there}` there" for name, (here, there) in differs.items()]
    if "compiled" in data:
        lines += ["", "```", *compiled_lines(data), "```"]
    return "\n".join(lines)


def plan_with(
    args: argparse.Namespace, model: torch.nn.Module, mesh: Any, *, rules_file: str | None, preset: str | None
) -> ShardingPlan:
    """Plans ``model`` with a rules file's rows, then a preset's; unused-rule warnings become notes on stderr."""
    rules = load_rules(rules_file) if rules_file else Rules()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnusedRuleWarning)
        if preset:  # hf_rules notes tp_plan entries this config leaves out
            rules = rules + preset_rules(preset, model, mesh, fsdp_axis=args.fsdp_axis, tp_axis=args.tp_axis)
        planned = plan(model, mesh, rules, default=args.default)
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)
    return planned


def compare(args: argparse.Namespace, model: torch.nn.Module, plan: ShardingPlan) -> dict[str, Any]:
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


def check_compile_args(args: argparse.Namespace) -> int | None:
    """Options that need ``--compile`` and what ``--compile`` needs; returns ``--device-memory`` in bytes."""
    given = [f"--{name.replace('_', '-')}" for name in compile_only() if getattr(args, name, None) is not None]
    if given and not args.compile:
        raise UsageError(f"{', '.join(given)} given without --compile; add --compile to compile the training step")
    if args.compile and args.batch is None:
        raise UsageError("--compile needs --batch, e.g. --batch 256x4096 for [batch, sequence] token ids")
    return parse_device_memory(args.device_memory) if args.device_memory is not None else None


def parse_device_memory(text: str) -> int:
    """``--device-memory``: a size (`parse_size`) of at least one byte, else a `UsageError` saying so.

    Examples:
        >>> parse_device_memory("80GiB") == 80 * 2**30
        True
    """
    size = parse_size(text)
    if size < 1:
        raise UsageError(f"--device-memory {text!r} is {size} bytes; give a device's memory, e.g. 80GiB")
    return size


def run_plan(args: argparse.Namespace) -> tuple[str, bool]:
    """Builds, plans (with ``--compile``, compiles the step) and formats; returns the text and whether it fits.

    Raises:
        UsageError: a command-line mistake.
        ShardingError: the plan, the Trainer's options or the batch do not fit the model and mesh.
    """
    device_memory = check_compile_args(args)
    axes = parse_mesh(args.mesh)
    if args.compile:
        strategy_options(args, axes)  # the strategies' flags' mistakes before the model is built
    devices = devices_for(axes) if args.compile else None  # before anything starts JAX's backend
    model = build_on_meta(load_factory(args.target))
    mesh, abstract = (make_mesh(axes, devices=devices), False) if devices else build_mesh(axes)
    plan = plan_with(args, model, mesh, rules_file=args.rules, preset=args.preset)
    data = report(model, plan, abstract=abstract, top=args.top, param_dtype=master_dtype(args.precision))
    if args.compare:
        data["compare"] = compare(args, model, plan)
    if devices:
        data["simulated_devices"] = len(devices)
        data |= compile_report(args, model, plan, load=load_factory)
        if device_memory is not None:
            data["device_memory"] = verdict(data, device_memory)
    fits = data.get("device_memory", {}).get("fits", True)
    if args.format == "json":
        return json.dumps(data, indent=2), fits
    if args.format == "markdown":
        return format_markdown(data, plan), fits
    return format_text(data, _compact(plan) if args.format == "compact" else plan.table()), fits


def _compact(plan: ShardingPlan) -> str:
    out = io.StringIO()
    visualize_plan(plan, file=out)
    return out.getvalue().rstrip()
