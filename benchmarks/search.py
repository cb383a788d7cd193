"""How long the plan search takes, and where it ranks a published configuration.

    python benchmarks/search.py                      # Llama-3-8B (config only) on 64 simulated H100s, batch 128x8192
    python benchmarks/search.py --tiny               # a 4-layer tiny Llama on 8 devices (the smoke test)
    python benchmarks/search.py --devices 8 --batch 16x8192 --published data=8:dots_saveable   # torchtitan's 8B
    python benchmarks/search.py --model llama3-70b --hardware a100 --batch 64x8192 --max-compiles 3 \
        --published data=64:nothing_saveable                                              # torchtitan's 70B

Prints the wall-clock time of the whole search (model built on meta, every compile included), the
best configurations, and, for ``--published MESH[:REMAT]`` (scanned, bf16, no accumulation; full
activation checkpointing is ``nothing_saveable``, torchtitan's selective op AC is closest to
``dots_saveable``), that layout compiled (if the search did not) with its estimate and its rank among
the fitting configurations the search compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import transformers

import torchshard as ts
from torchshard._hlo.hardware import hardware
from torchshard._report.fit import lm_loss, simulated_devices
from torchshard._search import search as engine
from torchshard._search.space import SearchLayout, mesh_axes

MODELS = {  # Llama 3 8B / 70B and Llama 2 70B, as their Hugging Face configs give them
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0),
    "llama2-70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, rope_theta=10000.0),
}  # fmt: skip


def llama(name: str) -> transformers.LlamaForCausalLM:
    fields = dict(MODELS[name])
    theta = fields.pop("rope_theta")
    config = transformers.LlamaConfig(**fields, max_position_embeddings=8192, rms_norm_eps=1e-5, use_cache=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": theta})  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tiny() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, use_cache=False)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def published_layout(text: str) -> SearchLayout:
    """``data=8,model=2:dots_saveable`` as a scanned bf16 layout without accumulation."""
    mesh, _, remat = text.partition(":")
    axes = {k: int(v) for k, v in (p.split("=") for p in mesh.split(","))}
    return SearchLayout(tuple((a, axes.get(a, 1)) for a in mesh_axes()), remat or "nothing_saveable", True, "bf16")


def row(c: engine.Candidate, devices: int) -> str:
    return (f"{c.layout.label():<60} peak {c.peak_bytes / 2**30:7.2f} GiB fits={c.fits} {c.step_seconds * 1e3:9.1f} ms "
            f"{c.tokens_per_second / devices:9.0f} tok/s/device MFU {c.mfu:.1%} ({c.dominant}; compute "
            f"{c.parts['compute'] * 1e3:.0f} ms, memory {c.parts['memory'] * 1e3:.0f} ms, attention tiles "
            f"{c.parts.get('attention tiles', 0.0) * 1e3:.0f} ms)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--batch", default="128x8192")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--max-compiles", type=int, help="candidates compiled (default: 20; --tiny: 4)")
    parser.add_argument("--published", help="a layout to compile and rank: MESH[:REMAT], e.g. data=8:dots_saveable")
    parser.add_argument("--json", help="write the candidates here")
    args = parser.parse_args()
    devices = 8 if args.tiny else args.devices
    ts.use_cpu_devices(devices)
    rows, seq = (8, 32) if args.tiny else map(int, args.batch.split("x"))
    with torch.device("meta"):
        model = tiny() if args.tiny else llama(args.model)
    begun = time.perf_counter()
    found = ts.inspect.search(model, devices=devices, batch=(rows, seq), hardware_name=args.hardware,
                              max_compiles=args.max_compiles or (4 if args.tiny else 20),
                              progress=lambda i, n, what: print(f"[{i}/{n}] {time.perf_counter() - begun:.0f} s {what}",
                                                                file=sys.stderr, flush=True))  # fmt: skip
    seconds = time.perf_counter() - begun
    compiled = [c for c in found if c.peak_bytes is not None]
    print(
        f"search: {args.model if not args.tiny else 'tiny'} on {devices} x {args.hardware}, batch {rows}x{seq}: "
        f"{len(found)} configurations, {len(compiled)} compiled, {seconds:.0f} s wall clock "
        f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end)"
    )
    for i, c in enumerate(compiled[:10], 1):
        print(f"{i:3d}. {row(c, devices)}")
    if args.published:
        layout = published_layout(args.published)
        hw = hardware(args.hardware)
        problem = engine.Problem(model, (rows, seq), devices, hw, hw.memory_bytes, min(hw.devices_per_host, devices),
                                 lm_loss)  # fmt: skip
        mine = engine.rate(problem, layout, *engine.measure(problem, layout, simulated_devices(devices)))
        rank = sum(c.fits and c.layout != layout and c.step_seconds < mine.step_seconds for c in compiled) + 1
        verdict = f"rank {rank} of {sum(bool(c.fits) for c in compiled if c.layout != layout) + 1} that fit"
        if not mine.fits:  # where its estimated time alone would put it among everything compiled
            faster = sum(c.layout != layout and c.step_seconds < mine.step_seconds for c in compiled)
            total = len({c.layout for c in compiled} | {layout})
            verdict = f"does not fit; by estimated time alone {faster + 1} of {total}"
        print(f"published {args.published}: {row(mine, devices)}; {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "candidates": [c.to_json() for c in found]}, f, indent=1)


if __name__ == "__main__":
    main()
