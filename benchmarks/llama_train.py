"""Llama training throughput under torchshard: FSDP and FSDP×TP, with and without bf16, remat and scan.

For each variant it prints tokens/s, model FLOP/s and MFU (6·N·tokens plus attention, over the
device's peak: a small table, ``--peak-tflops``, or on CPU a plain jitted GEMM measured in the same
run), the first step's trace and compile time, the compiled step's temp memory, and (``--torch``)
eager torch on the same device in its own process. ``--compile-layers 4,32`` compares the compile
time of scanned Llamas of those depths.

Run::

    python benchmarks/llama_train.py --preset tiny                 # CPU smoke, 8 simulated devices
    python benchmarks/llama_train.py --preset small --torch        # the issue-14 workload on CPU
    python benchmarks/llama_train.py --preset 1b --cpu-devices 0 --torch --compile-layers 4,32   # one GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any


@dataclasses.dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq: int
    batch: int


PRESETS = {
    "tiny": Preset(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256, vocab=1024, seq=64, batch=16),
    "small": Preset(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1376, vocab=8000, seq=256, batch=16),
    # Llama-3.2-1B's shapes (vocabulary 128256, tied embeddings), on one GPU
    "1b": Preset(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, seq=2048, batch=8),
}
# dense bf16 peak TFLOP/s by device kind (vendor figures, no sparsity)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "TPU v5 lite": 197.0, "TPU v5p": 459.0,
               "TPU v4": 275.0, "TPU v6 lite": 918.0}  # fmt: skip
DEFAULT_VARIANTS = "fsdp,fsdp+bf16,fsdp+bf16+scan+remat,fsdp_tp+bf16+scan+remat"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--layers", type=int, help="override the preset's depth")
    parser.add_argument("--batch", type=int, help="override the preset's global batch")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma list of mesh[+bf16][+scan][+remat]")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices; 0 uses the backend's")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, help="the device's peak, for MFU")
    parser.add_argument("--torch", action="store_true", help="also time eager torch in its own process")
    parser.add_argument("--compile-layers", default="", help="e.g. 4,32: compile time of scanned depths")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def preset_of(args: argparse.Namespace) -> Preset:
    preset = PRESETS[args.preset]
    changes = {k: v for k, v in (("layers", args.layers), ("batch", args.batch)) if v}
    return dataclasses.replace(preset, **changes)


def build(preset: Preset, layers: int | None = None) -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=preset.vocab, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
        num_hidden_layers=layers or preset.layers, num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads, max_position_embeddings=preset.seq,
        tie_word_embeddings=preset.vocab > 100_000, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def model_flops(model: Any, preset: Preset) -> float:
    """Training FLOPs of one step: 6·N per token (N without the input embedding) plus attention (PaLM's 12·L·d·s)."""
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    n = params - (0 if tied else embedding)
    tokens = preset.batch * preset.seq
    return 6.0 * n * tokens + 12.0 * preset.layers * preset.hidden * preset.seq * tokens


def batch_of(preset: Preset) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, preset.vocab, (preset.batch, preset.seq), generator=g)


def loss_fn(model: Any, ids: Any) -> Any:
    return model(input_ids=ids, labels=ids).loss


def variant_kwargs(variant: str) -> tuple[str, dict[str, Any]]:
    import torchshard as ts

    mesh, *flags = variant.split("+")
    kwargs: dict[str, Any] = {}
    if "bf16" in flags:
        kwargs["precision"] = ts.MixedPrecision()
    if "scan" in flags:
        kwargs["scan_layers"] = True
    if "remat" in flags:
        kwargs["remat"] = r"model\.layers\.\d+"
    return mesh, kwargs


def mesh_and_rules(name: str, model: Any) -> tuple[Any, Any]:
    import jax

    import torchshard as ts

    n = jax.device_count()
    if name == "fsdp_tp" and n >= 2:
        mesh = ts.make_mesh({"data": n // 2, "model": 2})
        return mesh, ts.presets.hf_rules(model)
    return ts.make_mesh({"data": n}), ts.presets.fsdp()


def timed(fn: Any, steps: int, warmup: int) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_variant(variant: str, preset: Preset, args: argparse.Namespace) -> dict[str, Any]:
    import optax

    import torchshard as ts

    mesh_name, kwargs = variant_kwargs(variant)
    model = build(preset)
    flops = model_flops(model, preset)
    mesh, rules = mesh_and_rules(mesh_name, model)
    trainer = ts.Trainer(model, loss_fn, optax.adamw(1e-4), ts.plan(model, mesh, rules), **kwargs)
    ids = batch_of(preset)
    start = time.perf_counter()
    lowered = trainer.lower(ids)
    traced = time.perf_counter() - start
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start - traced
    temp = compiled.memory_analysis().temp_size_in_bytes
    step_s = timed(lambda: trainer.step(ids)["loss"], args.steps, args.warmup)
    return {"variant": variant, "mesh": dict(mesh.shape), "step_s": step_s, "tokens_per_s": preset.batch * preset.seq
            / step_s, "flops_per_step": flops, "tflops": flops / step_s / 1e12, "trace_s": traced,
            "compile_s": compile_s, "temp_mib": temp / 2**20}  # fmt: skip


def gemm_tflops() -> float:
    """FLOP/s of a plain jitted fp32 GEMM sharded over every device: the attainable peak on CPU."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import torchshard as ts

    mesh, n = ts.make_mesh({"data": jax.device_count()}), 1024
    x = jax.device_put(jnp.ones((n * jax.device_count(), n)), NamedSharding(mesh, PartitionSpec("data")))
    w = jax.device_put(jnp.ones((n, n)), NamedSharding(mesh, PartitionSpec()))
    f = jax.jit(lambda a, b: a @ b)
    return 2 * n**3 * jax.device_count() / timed(lambda: f(x, w), 10, 3) / 1e12


def peak_tflops(args: argparse.Namespace) -> tuple[float, str]:
    import jax

    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return peak * jax.device_count(), f"{kind} bf16 peak"
    return gemm_tflops(), f"{kind}: a plain jitted GEMM in this run"


def compile_scaling(preset: Preset, depths: list[int]) -> list[dict[str, Any]]:
    import optax

    import torchshard as ts

    rows = []
    for depth in depths:
        model = build(preset, layers=depth)
        mesh, rules = mesh_and_rules("fsdp", model)
        trainer = ts.Trainer(model, loss_fn, optax.adamw(1e-4), ts.plan(model, mesh, rules), scan_layers=True,
                             precision=ts.MixedPrecision(), remat=r"model\.layers\.\d+")  # fmt: skip
        start = time.perf_counter()
        trainer.lower(batch_of(preset)).compile()
        rows.append({"layers": depth, "first_step_compile_s": time.perf_counter() - start})
    return rows


def torch_worker(args: argparse.Namespace) -> None:
    """Eager torch training steps on this process's device; prints one JSON line."""
    import torch

    preset = preset_of(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(preset).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = batch_of(preset).to(device)
    bf16 = device == "cuda"

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"device": device, "bf16_autocast": bf16, "step_s": statistics.median(times)}))


def run_torch(args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--torch-worker", "--preset", args.preset, "--steps", str(args.steps),
            "--warmup", str(args.warmup)] + (["--layers", str(args.layers)] if args.layers else []) + (
            ["--batch", str(args.batch)] if args.batch else [])  # fmt: skip
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode:  # show why: the parent's JSON table is lost otherwise
        raise SystemExit(f"eager torch worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(preset: Preset, rows: list[dict[str, Any]], peak: tuple[float, str], extra: dict[str, Any]) -> str:
    lines = [f"preset {preset}; peak {peak[0]:.1f} TFLOP/s ({peak[1]})", "",
             "| variant | mesh | s/step | tokens/s | TFLOP/s | MFU | trace (s) | compile (s) | temp memory (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        mesh = "×".join(f"{k}={v}" for k, v in r["mesh"].items())
        cells = [
            r["variant"],
            mesh,
            f"{r['step_s']:.3f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['tflops']:.3f}",
            f"{r['tflops'] / peak[0]:.1%}",
            f"{r['trace_s']:.1f}",
            f"{r['compile_s']:.1f}",
            f"{r['temp_mib']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if "torch" in extra:
        t = extra["torch"]
        lines.append(f"\neager torch ({t['device']}, own process{', bf16 autocast' if t['bf16_autocast'] else ''}): "
                     f"{t['step_s']:.3f} s/step")  # fmt: skip
    if "compile" in extra:
        c = extra["compile"]
        ratio = c[-1]["first_step_compile_s"] / c[0]["first_step_compile_s"]
        times = ", ".join(f"{r['layers']} layers {r['first_step_compile_s']:.1f} s" for r in c)
        lines.append(f"\nscanned first-step trace+compile: {times} ({ratio:.2f}×)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_worker:
        torch_worker(args)
        return 0
    import torchshard as ts

    if args.cpu_devices:
        ts.use_cpu_devices(args.cpu_devices)
    preset = preset_of(args)
    extra: dict[str, Any] = {}
    if args.torch:  # first: once JAX starts on a GPU it preallocates most of its memory, and torch's run would OOM
        extra["torch"] = run_torch(args)
    rows = []
    for variant in filter(None, args.variants.split(",")):
        rows.append(run_variant(variant, preset, args))
        print(f"{variant}: {rows[-1]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
    if args.compile_layers:
        extra["compile"] = compile_scaling(preset, [int(d) for d in args.compile_layers.split(",")])
    peak = peak_tflops(args)
    print(report(preset, rows, peak, extra))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": dataclasses.asdict(preset), "rows": rows, "peak": peak, **extra}, f, indent=1)
    return 0 if all(math.isfinite(r["step_s"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
