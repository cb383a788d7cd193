"""How long the plan search takes, and where it ranks a published configuration.

    python benchmarks/search.py                      # Llama-3-8B (config only) on 64 simulated H100s, batch 128x8192
    python benchmarks/search.py --tiny               # a 4-layer tiny Llama on 8 devices (the smoke test)
    python benchmarks/search.py --devices 8 --batch 16x8192 --published data=8   # torchtitan's 8B on 8 H100s

Prints the wall-clock time of the whole search (model built on meta, every compile included), the
best configurations, and the rank and estimate of ``--published`` (a mesh, compiled if the search did not).
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


def llama3_8b(layers: int = 32) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, use_cache=False)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tiny() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, use_cache=False)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--batch", default="128x8192")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--max-compiles", type=int, default=40)
    parser.add_argument("--published", help="a mesh such as data=8 to rank (its first layout)")
    parser.add_argument("--json", help="write the candidates here")
    args = parser.parse_args()
    devices = 8 if args.tiny else args.devices
    ts.use_cpu_devices(devices)
    rows, seq = (8, 32) if args.tiny else map(int, args.batch.split("x"))
    with torch.device("meta"):
        model = tiny() if args.tiny else llama3_8b()
    begun = time.perf_counter()
    found = ts.inspect.search(model, devices=devices, batch=(rows, seq), hardware_name=args.hardware,
                              max_compiles=4 if args.tiny else args.max_compiles,
                              progress=lambda i, n, what: print(f"[{i}/{n}] {time.perf_counter() - begun:.0f} s {what}",
                                                                file=sys.stderr, flush=True))  # fmt: skip
    seconds = time.perf_counter() - begun
    compiled = [c for c in found if c.peak_bytes is not None]
    print(
        f"search: {len(found)} configurations, {len(compiled)} compiled, {seconds:.0f} s wall clock "
        f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end)"
    )
    for i, c in enumerate(compiled[:10], 1):
        print(
            f"{i:3d}. {c.layout.label():<60} peak {c.peak_bytes / 2**30:7.2f} GiB fits={c.fits} "
            f"{c.step_seconds * 1e3:9.1f} ms {c.tokens_per_second / devices:9.0f} tok/s/device MFU {c.mfu:.1%} "
            f"({c.dominant})"
        )
    if args.published:
        want = {k: int(v) for k, v in (p.split("=") for p in args.published.split(","))}
        rank = next((i for i, c in enumerate(compiled, 1) if c.mesh == want | {"data": want.get("data", 1)}), None)
        print(f"published {args.published}: rank {rank} of {len(compiled)} compiled")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "candidates": [c.to_json() for c in found]}, f, indent=1)


if __name__ == "__main__":
    main()
