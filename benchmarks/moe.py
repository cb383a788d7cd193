"""Expert dispatch: bytes moved per device per step and step time, all-to-all vs GSPMD, on one model and mesh.

A Qwen2-MoE-shaped transformers model (tiny sizes, 8 experts, top-2, a shared expert) on
data=2 × expert=4 CPU devices, experts sharded by ``hf_rules(axis=None, expert_axis="expert")``,
the batch split over both axes. Bytes are what ``ts.inspect.collectives`` reads from the compiled
step (each collective's result on one device); times are the median of interleaved rounds.

    python benchmarks/moe.py            # the table in the README
    python benchmarks/moe.py --tiny     # seconds; what the smoke test runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torchshard as ts

KINDS: list[tuple[str, dict[str, Any]]] = [
    ("gspmd", {"kind": "gspmd"}),
    ("all_to_all (dropless)", {}),
    ("all_to_all capacity 1.25", {"capacity_factor": 1.25}),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a smaller batch and one timed round")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the rows here")
    return parser.parse_args()


def build():
    import torch
    import transformers

    config = transformers.Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(config)


def lm_loss(model, ids):
    import torch.nn.functional as F

    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def main() -> None:
    args = parse_args()
    if args.tiny:
        args.batch, args.seq, args.rounds = 16, 32, 1
    ts.use_cpu_devices(8)
    import jax
    import optax
    import torch
    from jax.sharding import PartitionSpec as P

    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    trainers, rows = {}, []
    for name, kwargs in KINDS:
        model = build()
        rules = ts.presets.hf_rules(model, axis=None, expert_axis="expert", fsdp_min_size=1024)
        plan = ts.plan(model, ts.make_mesh({"data": 2, "expert": 4}), rules)
        trainer = ts.Trainer(model, lm_loss, optax.adamw(1e-3), plan, batch_spec=P(("data", "expert")),
                             expert_dispatch=ts.ExpertDispatch(**kwargs))  # fmt: skip
        stats = ts.inspect.collectives(trainer, ids)
        placed = trainer.place_batch(ids)
        loss = float(trainer.step(placed)["loss"])  # compile
        trainers[name] = (trainer, placed)
        rows.append({"dispatch": name, "bytes": stats.nbytes(), "all_to_all_bytes": stats.nbytes("all-to-all"),
                     "first_loss": loss})  # fmt: skip
        print(f"built {name}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.rounds):
        for name, (trainer, placed) in trainers.items():
            start = time.perf_counter()
            jax.block_until_ready(trainer.step(placed)["loss"])
            times[name].append(time.perf_counter() - start)
    base = rows[0]["bytes"]
    mib = 2**20
    print(f"\nQwen2-MoE-shaped, 2 layers, 8 experts top-2, batch {args.batch}×{args.seq}, data=2 × expert=4\n")
    print("| dispatch | bytes/device/step (MiB) | ÷ gspmd | of which all-to-all (MiB) | step (ms) | first loss |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        row["step_ms"] = 1e3 * statistics.median(times[row["dispatch"]])
        print(f"| {row['dispatch']} | {row['bytes'] / mib:.2f} | {row['bytes'] / base:.2f} | "
              f"{row['all_to_all_bytes'] / mib:.2f} | {row['step_ms']:.0f} | {row['first_loss']:.4f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
