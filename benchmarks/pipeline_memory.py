"""Host memory of building and training a pipelined model: peak RSS of stage=4×data=2 against data=8 replicated.

On simulated CPU devices every device's buffers live in the process, so peak RSS counts what all
8 devices hold. The model is a plain-torch residual stack (8 pre-norm MLP blocks, 268 MB of fp32
weights at the defaults), created on the devices by `init_sharded` (the pipelined one with its
`Pipeline`, so each stage's layers only on its devices; ``--build host``: built on the CPU and
placed by the Trainer), handed to a `Trainer` with every tensor replicated over ``data``
(``presets.data_parallel``) and trained a few steps with SGD without momentum, so that
parameters (and their gradients) dominate. Each configuration runs in its own process (peak RSS
is per process); the ratio is pipelined over replicated, measured in the same run. The peak
covers construction and the first steps.

    python benchmarks/pipeline_memory.py          # the README figures
    python benchmarks/pipeline_memory.py --tiny   # seconds; what the smoke test runs
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

CONFIGS = {"replicated data=8": {"data": 8}, "pipelined stage=4×data=2": {"stage": 4, "data": 2}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a small model (the smoke test)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--build",
        choices=["host", "meta"],
        default="meta",
        help="meta: init_sharded (with the Pipeline); host: built on the CPU, handed to the Trainer",
    )
    parser.add_argument("--schedule", default="gpipe", help="the Pipeline's schedule")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run one configuration and print its peak RSS
    return parser.parse_args()


def child(args: argparse.Namespace) -> None:
    import torchshard as ts

    ts.use_cpu_devices(8)
    import jax
    import optax
    import torch
    from pipeline import build, mse

    axes = CONFIGS[args.child]
    mesh, rules = ts.make_mesh(axes), ts.presets.data_parallel()
    pipeline = ts.Pipeline(microbatches=4, schedule=args.schedule) if "stage" in axes else None
    if args.build == "meta":  # created on the devices, each stage's layers on its own
        model = ts.init_sharded(lambda: build(args.dim, args.hidden, args.depth), mesh, rules, pipeline=pipeline)
    else:
        model = build(args.dim, args.hidden, args.depth)
    g = torch.Generator().manual_seed(1)
    shape = (args.batch, args.seq, args.dim)
    batch = (torch.randn(*shape, generator=g), torch.randn(*shape, generator=g))
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    plan = ts.plan(model, mesh, rules)
    trainer = ts.Trainer(model, mse, optax.sgd(1e-3), plan, pipeline=pipeline)
    del model  # the trainer owns the module now: the host copy of the weights goes once they are placed
    constructed = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    compiled = trainer.lower(batch).compile().memory_analysis()
    for _ in range(args.steps):
        loss = trainer.step(batch)["loss"]
    jax.block_until_ready(loss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"config": args.child, "peak_rss_kib": peak, "model_built_rss_kib": built,
                      "constructed_rss_kib": constructed, "step_temp_bytes": compiled.temp_size_in_bytes,
                      "step_argument_bytes": compiled.argument_size_in_bytes}))  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.tiny:
        args.dim, args.hidden, args.depth, args.batch, args.seq, args.steps = 128, 512, 4, 8, 4, 2
    if args.child:
        child(args)
        return
    rows = []
    for name in CONFIGS:
        sizes = ["--dim", str(args.dim), "--hidden", str(args.hidden), "--depth", str(args.depth), "--batch",
                 str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--build", args.build,
                 "--schedule", args.schedule]  # fmt: skip
        done = subprocess.run([sys.executable, __file__, "--child", name, *sizes], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    weights = args.depth * 4 * (2 * args.dim * args.hidden + args.dim + args.hidden + 2 * args.dim)
    for row in rows:
        row["ratio"] = row["peak_rss_kib"] / rows[0]["peak_rss_kib"]
    print(f"\n{args.depth} blocks {args.dim}→{args.hidden}→{args.dim} ({weights / 1e6:.0f} MB of weights), SGD, "
          f"{args.steps} steps, 8 CPU devices, built on {args.build}, {args.schedule}\n")  # fmt: skip
    print("| config | RSS: model built (MiB) | peak RSS: Trainer built (MiB) | peak RSS: after the steps (MiB) | "
          "÷ replicated | step arguments + temp per device (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        step = (r["step_argument_bytes"] + r["step_temp_bytes"]) / 2**20
        print(f"| {r['config']} | {r['model_built_rss_kib'] / 1024:.0f} | {r['constructed_rss_kib'] / 1024:.0f} | "
              f"{r['peak_rss_kib'] / 1024:.0f} | {r['ratio']:.2f} | {step:.0f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
