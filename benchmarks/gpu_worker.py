"""One row of the device check (``benchmarks/gpu.py``), in a process of its own: eager torch, ``torch.compile``
or one torchshard variant trains a few steps and writes what it measured to a JSON file after every step.

Every variant builds the same model (one seed, initialised on the CPU, then moved), trains on the same three
batches in turn with the same AdamW, and reports the loss of its first three steps.

Run by ``benchmarks/gpu.py``; by hand::

    python benchmarks/gpu_worker.py --variant eager --out row.json --smoke
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llama_train import PRESETS, Preset, loss_fn, mesh_and_rules, model_flops, variant_kwargs
from op_profile import jax_profile, torch_profile

# Llama-3.2-1B's shapes (vocabulary 128,256, tied embeddings), 8 × 2,048 tokens; the smoke shape keeps its
# relations (tied embeddings, 4 query heads per KV head, intermediate 4× hidden) at toy sizes
SHAPES = {
    "1b": PRESETS["1b"],
    "smoke": Preset(hidden=64, layers=2, heads=4, kv_heads=1, intermediate=256, vocab=256, seq=64, batch=2),
}
ROPE_THETA = 500_000.0  # Llama 3's
LR, WEIGHT_DECAY = 1e-4, 0.1  # both optimizers get both explicitly: their default weight decays differ
N_BATCHES = 3  # step i trains on batch i % 3
PROFILED_STEPS = 2  # after the timed steps, under the profiler: where a step's time goes, op by op
TORCH_VARIANTS = ("eager", "compile")
# a torchshard variant: MESH+FLAG+...; one device, so one mesh (llama_train's fsdp_tp would run as plain fsdp)
MESHES = ("fsdp",)
FLAGS = ("bf16", "scan", "remat")  # llama_train's variant_kwargs
KEYS = ("attn", "remat", "loss", "xla")  # run_torchshard's KEY=VALUE flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, help="eager, compile, or a torchshard variant: fsdp+bf16[+...]")
    parser.add_argument("--out", required=True, help="the row's JSON file")
    parser.add_argument("--smoke", action="store_true", help="the toy shape on the CPU")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    args = parser.parse_args(argv)
    if problems := variant_problems([args.variant]):
        parser.error("; ".join(problems))
    return args


def keyed_choices(key: str) -> tuple[str, ...]:
    """The values the ``KEY=VALUE`` flag ``key`` takes: torchshard's own lists for attention kernels and remat."""
    if key == "attn":
        from torchshard._bridge.ops.kernels import KERNELS

        return tuple(KERNELS)
    if key == "remat":
        from torchshard._train.remat import POLICY_NAMES

        return tuple(POLICY_NAMES)
    return {"loss": ("unfused",), "xla": ("default",)}[key]


def variant_problems(variants: list[str]) -> list[str]:
    """Why each of ``variants`` is not one the check can run, each naming the valid values (none: all good).

    A variant is eager, compile, or ``MESH+FLAG+...``: MESH one of `MESHES`, a FLAG one of `FLAGS` or ``KEY=VALUE``
    with KEY one of `KEYS` (torchshard is imported for the values of ``attn`` and ``remat`` only).

    Examples:
        >>> variant_problems(["eager", "fsdp+bf16+loss=unfused", "fsdp+loss=fused"])
        ["variant 'fsdp+loss=fused': loss='fused' is not one of unfused"]
    """
    problems = []
    for variant in (v for v in variants if v not in TORCH_VARIANTS):
        mesh, *flags = variant.split("+")
        if mesh not in MESHES:
            problems.append(f"variant {variant!r}: unknown mesh {mesh!r}; give {', '.join(TORCH_VARIANTS)}, or "
                            f"{'/'.join(MESHES)}+FLAG+... (one device: no fsdp_tp)")  # fmt: skip
        for flag in flags:
            key, eq, value = flag.partition("=")
            if (eq and key not in KEYS) or (not eq and flag not in FLAGS):
                problems.append(f"variant {variant!r}: unknown flag {flag!r}; give {', '.join(FLAGS)} or KEY=VALUE "
                                f"with KEY one of {', '.join(KEYS)}")  # fmt: skip
            elif eq and value not in (choices := keyed_choices(key)):
                problems.append(f"variant {variant!r}: {key}={value!r} is not one of {', '.join(choices)}")
    return problems


def build(preset: Preset) -> Any:
    """The Llama, initialised on the CPU from seed 0: every process gets the same weights."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=preset.vocab, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
        num_hidden_layers=preset.layers, num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
        max_position_embeddings=preset.seq, tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa",
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def batches_of(preset: Preset) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, preset.vocab, (preset.batch, preset.seq), generator=g) for _ in range(N_BATCHES)]


class Row:
    """The row being measured; every update rewrites its file, so a run stopped at its time cap still says how
    far it got."""

    def __init__(self, path: str, variant: str) -> None:
        self.path, self.data = Path(path), {"variant": variant}

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.path.write_text(json.dumps(self.data, indent=1))


def train(step: Callable[[int], float], preset: Preset, args: argparse.Namespace, row: Row) -> None:
    """Runs ``step(i)`` (it returns the loss as a float, which waits for the step) warmup + steps times."""
    times, losses = [], []
    for i in range(max(args.warmup, 1) + args.steps):  # the first step compiles: it is never timed
        start = time.perf_counter()
        losses.append(step(i))
        elapsed = time.perf_counter() - start
        if i == 0:
            row.update(first_step_s=elapsed)
        if i >= max(args.warmup, 1):
            times.append(elapsed)
        row.update(losses=losses[:N_BATCHES], steps_done=i + 1)
    step_s = statistics.median(times)
    first = row.data["first_step_s"]
    row.update(step_s=step_s, tokens_per_s=preset.batch * preset.seq / step_s, compile_s=max(first - step_s, 0.0))


def profile(row: Row, run: Callable[[], list[dict[str, Any]]]) -> None:
    """The row's ``profile`` (its top ops, see op_profile.py); a profiler that fails leaves the timings standing."""
    try:
        row.update(profile=run())
    except Exception as err:  # the profile explains a time; it never voids one
        row.update(profile=[], profile_error=f"{type(err).__name__}: {str(err)[:300]}")


def host_peak_bytes() -> int:
    """This process's peak resident memory: the CPU's stand-in for a device's peak (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_gemm_tflops() -> float:
    """FLOP/s of a plain fp32 torch matmul on this CPU: the smoke run's stand-in for a peak."""
    import torch

    n, reps = 512, 8
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def run_torch(preset: Preset, args: argparse.Namespace, row: Row) -> None:
    """Eager torch (or ``torch.compile`` of the same model): bf16 autocast, SDPA, AdamW."""
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu":  # beside the suite's workers, torch's spinning threads made a 5 ms step take 100-500 ms
        torch.set_num_threads(1)
    model = build(preset)
    row.update(flops_per_step=model_flops(model, preset), params=sum(p.numel() for p in model.parameters()))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=device == "cuda")
    forward = model
    if args.variant == "compile":
        # inductor on a GPU; on the CPU the same dynamo and AOT-autograd capture without inductor's C++ build,
        # which would take minutes for a smoke run
        backend = "inductor" if device == "cuda" else "aot_eager"
        forward = torch.compile(model, backend=backend)
        row.update(note=f"backend {backend}")
    batches = [b.to(device) for b in batches_of(preset)]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    row.update(device=name, platform=device)
    if device == "cuda":
        row.update(torch_cuda=torch.version.cuda, torch_cudnn=torch.backends.cudnn.version())
    if device == "cpu":
        row.update(cpu_gemm_tflops=cpu_gemm_tflops())

    def step(i: int) -> float:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_fn(forward, batches[i % N_BATCHES])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    train(step, preset, args, row)
    if device == "cuda":
        row.update(peak_bytes=torch.cuda.max_memory_allocated(), peak_kind="device")
    else:
        row.update(peak_bytes=host_peak_bytes(), peak_kind="host RSS")
    profile(row, lambda: torch_profile(step, PROFILED_STEPS, cuda=device == "cuda"))


def kernel_summary(trainer: Any) -> str | None:
    """``trainer.kernels`` counted by kernel ("cudnn×16"), where the Trainer reports it."""
    kernels = getattr(trainer, "kernels", None)
    if not kernels:
        return None

    def name(choice: Any) -> str:
        for attr in ("kernel", "name"):
            if isinstance(getattr(choice, attr, None), str):
                return str(getattr(choice, attr))
        return str(choice[0]) if isinstance(choice, tuple | list) and choice else str(choice)

    counts = collections.Counter(name(choice) for choice in dict(kernels).values())
    return ", ".join(f"{kernel}×{n}" for kernel, n in counts.items())


def run_torchshard(preset: Preset, args: argparse.Namespace, row: Row) -> None:
    """One Trainer variant: ``mesh+flag+...`` as benchmarks/llama_train.py reads it, plus ``attn=KERNEL``,
    ``remat=POLICY`` (each layer), ``loss=unfused`` (``fused_loss=False``) and ``xla=default`` (no GPU flags)."""
    import jax
    import optax

    import torchshard as ts

    if args.smoke:
        ts.use_cpu_devices(1)  # the device check's one device
    flags = dict(f.split("=", 1) for f in args.variant.split("+") if "=" in f)
    if (
        flags.get("xla") == "default"
    ):  # XLA's own defaults: a set XLA_FLAGS (even empty) keeps torchshard's GPU flags out
        os.environ.setdefault("XLA_FLAGS", "")
    mesh_name, kwargs = variant_kwargs("+".join(f for f in args.variant.split("+") if "=" not in f))
    if "attn" in flags:
        kwargs["attention_kernel"] = flags["attn"]
    if "remat" in flags:
        kwargs["remat"] = ts.Remat(r"model\.layers\.\d+", policy=flags["remat"])
    if flags.get("loss") == "unfused":
        kwargs["fused_loss"] = False
    model = build(preset)
    row.update(flops_per_step=model_flops(model, preset), params=sum(p.numel() for p in model.parameters()))
    mesh, rules = mesh_and_rules(mesh_name, model)
    optimizer = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    trainer = ts.Trainer(model, loss_fn, optimizer, ts.plan(model, mesh, rules), **kwargs)
    batches = [ts.shard_batch(b, mesh) for b in batches_of(preset)]
    device = jax.devices()[0]
    row.update(device=device.device_kind, platform=device.platform, trainer_kwargs=sorted(kwargs))
    step = lambda i: float(trainer.step(batches[i % N_BATCHES])["loss"])  # noqa: E731  # float() waits for it
    train(step, preset, args, row)
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        row.update(peak_bytes=stats["peak_bytes_in_use"], peak_kind="device")
    else:  # XLA:CPU keeps no allocator statistics
        row.update(peak_bytes=host_peak_bytes(), peak_kind="host RSS")
    if summary := kernel_summary(trainer):
        row.update(kernels=summary)
    profile(row, lambda: jax_profile(step, PROFILED_STEPS))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = SHAPES["smoke" if args.smoke else "1b"]
    row = Row(args.out, args.variant)
    row.update(shape=dataclasses.asdict(preset))
    run = run_torch if args.variant in TORCH_VARIANTS else run_torchshard
    try:
        run(preset, args, row)
    except Exception as err:  # the row says why; the check goes on with the next variant
        row.update(error=f"{type(err).__name__}: {str(err)[:2000]}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
