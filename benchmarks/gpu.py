"""The prepared device check: eager torch, ``torch.compile`` and torchshard train a Llama-3.2-1B shape on one GPU.

Eager torch (bf16 autocast, SDPA) runs first, then ``torch.compile`` of the same model, then each torchshard
variant; each in a process of its own (``benchmarks/gpu_worker.py``) with a time cap, so that no run times
another's compiler or memory, and JAX, which takes most of a GPU's memory when it starts, starts after torch is
done. Every run has the same initial weights, batches (8 × 2,048 tokens) and AdamW. For each it reports tokens/s,
MFU (6·N·tokens + attention FLOPs against the device's dense bf16 peak), peak memory, the first step's compile
time (the first step's time less a timed step's) and its first three losses against eager torch's. A run that
fails (out of memory, a missing keyword, a time cap) is a row with its reason. It writes ``gpu.json`` and
``gpu.md`` to ``--out`` and prints the table.

A device machine reaches no package index: the pure-Python packages the check imports that its image may lack
(torchax, optax, absl-py) travel as wheels (``python3 dev.py gpu --wheels wheels/gpu`` fetches them), and are
unpacked into a temporary folder on the path for the missing imports only.

Run::

    python3 dev.py gpu                               # on the GPU machine: ≤ 8 minutes on one H100
    python benchmarks/gpu.py --smoke --out build/gpu-smoke    # the same on the CPU at a toy shape, < 1 minute
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from gpu_worker import SHAPES, TORCH_VARIANTS, variant_problems

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "gpu_worker.py"
# eager torch first (before JAX takes the GPU's memory), then torch.compile, then torchshard: its defaults (auto
# attention: cuDNN on a GPU, the fused loss, the GPU XLA flags), then each turned back one at a time, scan + remat,
# and last the attention kernels forced one by one (auto's is named in its row's kernels), which a spent budget
# leaves out first
VARIANTS = ("eager", "compile", "fsdp+bf16", "fsdp+bf16+attn=tiled", "fsdp+bf16+xla=default",
            "fsdp+bf16+loss=unfused", "fsdp+bf16+scan+remat=matmuls", "fsdp+bf16+attn=cudnn",
            "fsdp+bf16+attn=xla", "fsdp+bf16+attn=tokamax")  # fmt: skip
GPU_ONLY = ("fsdp+bf16+attn=cudnn",)  # left out of --smoke's default variants: the CPU has no such kernel
# left out of --smoke's default variants where tokamax cannot be imported (it needs Python >= 3.12, jax >= 0.11.1)
NEEDS_TOKAMAX = ("fsdp+bf16+attn=tokamax",)
LABELS = {"eager": "eager torch, bf16 autocast, SDPA", "compile": "torch.compile, bf16 autocast, SDPA"}
CAPS_S = {"eager": 90, "compile": 180}  # per variant; torchshard's get --cap
# module → the wheel that provides it, for the imports a device image may lack
WHEELS = {"torchax": "torchax", "optax": "optax", "absl": "absl_py"}
VERSIONS = ("torch", "jax", "jaxlib", "torchax", "optax", "absl-py", "transformers", "numpy")
LOSS_RTOL = 2e-2  # bf16 steps: eager torch's autocast and torchshard's MixedPrecision round differently
MIN_CAP_S = 20  # a variant with less time left than this is not started
LEAST = {  # option: its least value, and what it counts
    "steps": (1, "timed steps per variant, e.g. 5"),
    "warmup": (1, "untimed steps, e.g. 2 (the first step compiles and is never timed)"),
    "budget": (MIN_CAP_S, "seconds for the whole check, e.g. 480 (a variant with less left is not started)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the toy shape on the CPU, torch.compile via aot_eager")
    parser.add_argument("--out", help="where gpu.json and gpu.md go (default build/gpu, build/gpu-smoke)")
    parser.add_argument("--variants",
                        help="comma list: eager, compile, fsdp[+bf16][+scan][+remat][+attn=K][+remat=P][+loss=unfused]"
                        "[+xla=default]")  # fmt: skip
    parser.add_argument("--steps", type=int, help="timed steps per variant (>= 1; default 5; smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first, compile included (>= 1; default 2; smoke 1)")
    parser.add_argument("--cap", type=float, help="seconds one torchshard variant may take (default 150; smoke 120)")
    parser.add_argument("--budget", type=float,
                        help=f"seconds for the whole check (>= {MIN_CAP_S}; default 480; smoke 300)")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, if not H100/H200/A100")
    parser.add_argument("--wheel-dir", default=str(ROOT / "wheels" / "gpu"), help="wheels for missing imports")
    return parser


@functools.cache
def tokamax_imports() -> bool:
    """Whether ``import tokamax`` works in the workers' Python (this one), tried in a process of its own: importing
    it here would start JAX in the parent, which runs eager torch first."""
    probe = subprocess.run([sys.executable, "-c", "import tokamax"], capture_output=True, timeout=120, check=False)
    return probe.returncode == 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the defaults of a full or a ``--smoke`` run where one is not given (checked by `problems`)."""
    args = build_parser().parse_args(argv)
    smoke = args.smoke
    left_out = (GPU_ONLY + (() if tokamax_imports() else NEEDS_TOKAMAX)) if smoke else ()
    defaults = {"steps": 2 if smoke else 5, "warmup": 1 if smoke else 2, "cap": 120 if smoke else 150,
                "budget": 300 if smoke else 480,
                "variants": ",".join(v for v in VARIANTS if v not in left_out)}  # fmt: skip
    for name, default in defaults.items():
        if getattr(args, name) is None:  # not `or`: a 0 given is checked, not replaced
            setattr(args, name, default)
    args.out = Path(args.out or ROOT / "build" / ("gpu-smoke" if smoke else "gpu"))
    return args


def problems(args: argparse.Namespace) -> list[str]:
    """Every bad option, each naming the value and what to give instead: numbers, then the variants."""
    found = [f"--{name} {getattr(args, name)}: give at least {least} {what}"
             for name, (least, what) in LEAST.items() if not getattr(args, name) >= least]  # fmt: skip
    if not args.cap > 0:
        found.append(f"--cap {args.cap}: give seconds > 0 one torchshard variant may take, e.g. 150")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        found.append(f"--peak-tflops {args.peak_tflops}: give the device's dense bf16 TFLOP/s > 0, e.g. 989")
    variants = args.variants.split(",")
    if not any(variants):
        found.append(f"--variants {args.variants!r}: give one or more of {', '.join(VARIANTS)}")
    twice = sorted({v for v in variants if v and variants.count(v) > 1})
    if twice:
        found.append(f"--variants lists {', '.join(twice)} twice: each runs once (its row's files are per variant)")
    return found + [f"--variants: {p}" for p in variant_problems([v for v in variants if v])]


def unpack_missing(wheel_dir: Path, site: Path) -> dict[str, str]:
    """Unpacks the wheel of each module in WHEELS this Python cannot import into ``site``; returns module → wheel.

    A pure-Python wheel unpacked into a folder on the path is installed (``pip install --target`` does the same,
    and the device image may have no pip).
    """
    missing = [m for m in WHEELS if importlib.util.find_spec(m) is None]
    used: dict[str, str] = {}
    for module in missing:
        found = sorted(wheel_dir.glob(f"{WHEELS[module]}-*-py3-none-any.whl"))
        if not found:
            print(f"gpu: cannot import {module} and no {WHEELS[module]} wheel in {wheel_dir} (fetch them with "
                  f"`python3 dev.py gpu --wheels {wheel_dir}` where an index is reachable, and carry the folder)",
                  file=sys.stderr)  # fmt: skip
            continue
        with zipfile.ZipFile(found[-1]) as wheel:
            wheel.extractall(site)
        used[module] = found[-1].name
    if used:
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
    return used


def versions(wheels: dict[str, str]) -> dict[str, str]:
    """Each package's version (JAX's CUDA plugins and NVIDIA's cuDNN too), and whether it came from a carried wheel."""
    from_wheel = {w.split("-")[0].replace("_", "-") for w in wheels.values()}
    names = {d.metadata["Name"] or "" for d in importlib.metadata.distributions()}
    extra = {n for n in names if n.lower().replace("_", "-").startswith(("jax-cuda", "nvidia-cudnn"))}
    found = {}
    for name in (*VERSIONS, *sorted(extra)):
        try:
            found[name] = importlib.metadata.version(name) + (" (wheel)" if name in from_wheel else "")
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def worker_env(args: argparse.Namespace, site: Path) -> dict[str, str]:
    path = [str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    if args.smoke:  # the CPU, whatever this machine has
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    else:  # one JAX process per GPU at a time: let it use the memory torch leaves it (JAX's default is 75 %)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    return env


def run_variant(variant: str, cap: float, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Runs one variant's worker for at most ``cap`` seconds; its row, with an ``error`` where it failed."""
    out = args.out / "rows" / f"{variant.replace('+', '_').replace('=', '-')}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(WORKER), "--variant", variant, "--out", str(out), "--steps", str(args.steps),
           "--warmup", str(args.warmup), *(["--smoke"] if args.smoke else [])]  # fmt: skip
    log = args.out / "rows" / (out.stem + ".log")
    start = time.perf_counter()
    with log.open("w") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=stderr, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the worker and anything it started
            proc.wait()
            code = None
    row: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"variant": variant}
    row["wall_s"] = time.perf_counter() - start
    if code is None:
        row["error"] = f"stopped at its {cap:.0f} s cap after {row.get('steps_done', 0)} steps"
    elif code and "error" not in row:
        row["error"] = f"exit {code}: " + " | ".join(log.read_text().strip().splitlines()[-3:])[-600:]
    return row


def run_all(args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    rows, start = [], time.perf_counter()
    (args.out / "rows").mkdir(parents=True, exist_ok=True)
    for variant in filter(None, args.variants.split(",")):
        left = args.budget - (time.perf_counter() - start)
        if left < MIN_CAP_S:
            rows.append({"variant": variant, "skipped": f"the check's {args.budget:.0f} s budget is spent"})
            continue
        rows.append(run_variant(variant, min(CAPS_S.get(variant, args.cap), left), args, env))
        print(f"gpu: {summary(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def summary(row: dict[str, Any]) -> str:
    if "step_s" in row:
        return f"{row['variant']}: {row['step_s']:.3f} s/step, losses {row.get('losses')} ({row['wall_s']:.0f} s)"
    return f"{row['variant']}: {row.get('error') or row.get('skipped')}"


def peak_of(rows: list[dict[str, Any]], args: argparse.Namespace) -> tuple[float | None, str]:
    """The dense bf16 peak in TFLOP/s, and where it comes from: ts.inspect's profile of the device the rows ran on."""
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    names = [r["device"] for r in rows if r.get("device")]
    if not names:
        return None, "no run reached the device"
    if next(r["platform"] for r in rows if r.get("device")) == "cpu":
        gemm = next((r["cpu_gemm_tflops"] for r in rows if "cpu_gemm_tflops" in r), None)
        return gemm, "CPU: a plain fp32 torch matmul, measured in the eager worker"
    import torchshard as ts

    key = names[0].lower().replace(" ", "").replace("-", "")
    for profile in ts.inspect.PROFILES.values():
        if profile.name.replace("-", "") in key:
            return profile.bf16_flops / 1e12, f"{names[0]}: ts.inspect.hardware({profile.name!r}).bf16_flops"
    return None, f"{names[0]}: no profile (pass --peak-tflops)"


def compare(rows: list[dict[str, Any]], peak: float | None) -> None:
    """Adds MFU, speed against eager torch and the losses' largest relative difference from eager torch's."""
    eager = next((r for r in rows if r["variant"] == "eager" and "step_s" in r), None)
    platforms = [r["platform"] for r in rows if r.get("platform")]
    for r in rows:
        if r.get("platform") == "cpu" and platforms[0] != "cpu":  # e.g. a jax without its CUDA plugin
            r["note"] = "; ".join(filter(None, [r.get("note"), "ran on the CPU"]))
        if "step_s" in r:
            r["tflops"] = r["flops_per_step"] / r["step_s"] / 1e12
            r["mfu"] = r["tflops"] / peak if peak else None
            r["vs_eager"] = r["tokens_per_s"] / eager["tokens_per_s"] if eager else None
        if eager and r.get("losses") and r is not eager:
            pairs = list(zip(r["losses"], eager["losses"], strict=False))
            r["loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in pairs)
            r["losses_match"] = r["loss_rel_diff"] <= LOSS_RTOL and len(pairs) == len(eager["losses"])


def cell(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | tokens/s | s/step | vs eager | MFU | peak memory (GiB) | first-step compile (s) | first 3 losses "
             f"| vs eager (rtol {LOSS_RTOL:g}) | note |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        label = LABELS.get(r["variant"], f"torchshard {r['variant']}")
        note = "; ".join(str(r[k]) for k in ("error", "skipped", "note", "kernels") if r.get(k))
        if r.get("peak_kind") == "host RSS":
            note = "; ".join(filter(None, [note, "memory is the process's peak RSS"]))
        losses = ", ".join(f"{x:.4f}" for x in r.get("losses", [])) or "—"
        match = "" if r["variant"] == "eager" or "losses_match" not in r else (
            f"{'yes' if r['losses_match'] else '**NO**'} ({r['loss_rel_diff']:.1e})")  # fmt: skip
        peak = r["peak_bytes"] / 2**30 if "peak_bytes" in r else None
        speed = cell(r.get("vs_eager"), ".2f") + ("×" if r.get("vs_eager") else "")
        cells = [label, cell(r.get("tokens_per_s"), ",.0f"), cell(r.get("step_s"), ".3f"), speed,
                 cell(r.get("mfu"), ".1%"), cell(peak, ".2f"), cell(r.get("compile_s"), ".1f"), losses,
                 match or "—", note.replace("|", "/")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profiles(rows: list[dict[str, Any]]) -> str:
    """Each run's top ops by device time (``"profile"``, from the worker's profiler), as markdown tables."""
    parts = []
    for r in rows:
        if not r.get("profile"):
            continue
        label = LABELS.get(r["variant"], f"torchshard {r['variant']}")
        lines = [f"### {label}", "", "| op | ms/step | share |", "|---|---|---|"]
        lines += [f"| `{p['op'][:80].replace('|', '/')}` | {p['ms']:.3f} | {p['share']:.1%} |" for p in r["profile"]]
        parts.append("\n".join(lines))
    return "\n\n".join(["## Where the time goes (top ops by device time)", *parts]) if parts else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    site = Path(tempfile.mkdtemp(prefix="torchshard-gpu-site-"))  # not under --out: it is not a result
    try:
        wheels = unpack_missing(Path(args.wheel_dir), site)
        # after the unpacking (the variants' attn= and remat= values are torchshard's lists), before anything runs
        if bad := problems(args):
            build_parser().error(f"{len(bad)} bad option(s), nothing run:\n" + "\n".join(f"  - {p}" for p in bad))
        args.out.mkdir(parents=True, exist_ok=True)
        found = versions(wheels)
        print("gpu: " + ", ".join(f"{k} {v}" for k, v in found.items()), file=sys.stderr, flush=True)
        rows = run_all(args, worker_env(args, site))
    finally:
        shutil.rmtree(site, ignore_errors=True)
    peak, peak_source = peak_of(rows, args)
    compare(rows, peak)
    shape = dataclasses.asdict(SHAPES["smoke" if args.smoke else "1b"])
    device = next((r["device"] for r in rows if r.get("device")), "unknown")
    stack = ", ".join(f"{k} {v}" for k, v in found.items())
    head = (f"{device}, {datetime.date.today()}; Llama {shape}, tied embeddings, AdamW, {args.warmup} warmup + "
            f"{args.steps} timed steps; peak {cell(peak, '.3g')} TFLOP/s ({peak_source}); {stack}")  # fmt: skip
    markdown = f"{head}\n\n{table(rows)}\n" + (f"\n{ops}\n" if (ops := profiles(rows)) else "")
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "smoke": args.smoke, "device": device,
              "versions": found, "shape": shape, "steps": args.steps,
              "warmup": args.warmup, "peak_tflops": peak, "peak_source": peak_source, "loss_rtol": LOSS_RTOL,
              "torch_variants": list(TORCH_VARIANTS), "rows": rows}  # fmt: skip
    (args.out / "gpu.json").write_text(json.dumps(result, indent=1))
    (args.out / "gpu.md").write_text(markdown)
    print(markdown)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
