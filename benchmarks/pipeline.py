"""Pipeline parallelism: per-device memory, step time and the measured bubble of gpipe, circular, 1f1b, 1f1b_remat
and zero_bubble.

The model is a residual stack in plain torch (pre-norm MLP blocks, MSE loss, AdamW); every tensor
is replicated over the data axis (``presets.data_parallel``), so only the pipeline splits weights.

Table 1, memory and time on 8 devices: unpipelined data=8 against 1, 2 and 4 stages (the rest of
the devices over data), gpipe and circular. For each: the parameter bytes each device holds, the
compiled step's per-device argument and temp bytes (``memory_analysis``; a 1f1b or 1f1b_remat row's temp
also over gpipe's on the same stages, without remat), and the median wall and CPU time of a step
(configurations interleaved in rounds).

Table 2, the bubble: pipelines over S = 1, 2, 4 devices (a mesh of the stage axis alone), every
block checkpointed so that the schedules recompute alike, against the formula
``(S-1)/(repeats*M + S-1)``. Measured: each schedule runs with M and with 2M micro-batches of the
same rows (the batch doubled); the difference is the cost of ``repeats*M`` more loop iterations,
which gives the cost of one, and the bubble is the cost of the ``S-1`` fill-and-drain iterations
over the step's: ``(S-1) * (t(2M) - t(M)) / (repeats*M) / t(M)``. It comes out below the formula
by the share of the step outside the loop (loss, optimizer). Simulated CPU devices share the
host's cores: a stage in the bubble computes a placeholder micro-batch instead of idling, so the
bubble costs compute in proportion, and CPU time (all threads of the process) measures it whatever
else the machine runs.

Table 3 (``--comm``, compiled only, nothing runs): FSDP over data inside the stages, stage=4 × data=2
against the unpipelined step on the same mesh and plan: per schedule the collective bytes per device
per step over each axis group (``ts.inspect.collectives``, loop trip counts applied), the temp bytes (also
against 1f1b's), and the matmul FLOPs per step (trip counts applied) against the unpipelined step's and against
gpipe's; the wasted FLOPs (the bubble's placeholder micro-batches: FLOPs - recomputed - the data=8 step's per
device) against gpipe's.

    python benchmarks/pipeline.py           # the README tables
    python benchmarks/pipeline.py --comm    # table 3
    python benchmarks/pipeline.py --tiny    # seconds; what the smoke test runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import torchshard as ts


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    stages: int  # 0: unpipelined
    schedule: str = "gpipe"
    repeats: int = 1
    devices: int = 8  # the stage axis takes `stages` of them, the data axis the rest
    remat: bool = False
    scale: int = 1  # micro-batches and batch rows × this (the same rows per micro-batch)


MEMORY = [
    Config("unpipelined", 0),
    Config("gpipe S=1", 1),
    Config("gpipe S=2", 2),
    Config("gpipe S=4", 4),
    Config("circular S=2 r=2", 2, "circular", 2),
    Config("circular S=4 r=2", 4, "circular", 2),
    Config("1f1b S=2", 2, "1f1b"),
    Config("1f1b S=4", 4, "1f1b"),
    Config("1f1b_remat S=2", 2, "1f1b_remat"),
    Config("1f1b_remat S=4", 4, "1f1b_remat"),
]
TINY_MEMORY = ("unpipelined", "gpipe S=4", "circular S=2 r=2", "1f1b S=4", "1f1b_remat S=4")
BUBBLE = [
    Config(f"{name}{' ×2' if scale == 2 else ''}", stages, schedule, repeats, stages, True, scale)
    for name, stages, schedule, repeats in [
        ("gpipe S=1", 1, "gpipe", 1),
        ("gpipe S=2", 2, "gpipe", 1),
        ("gpipe S=4", 4, "gpipe", 1),
        ("circular S=2 r=2", 2, "circular", 2),
        ("circular S=4 r=2", 4, "circular", 2),
        ("1f1b S=2", 2, "1f1b", 1),
        ("1f1b S=4", 4, "1f1b", 1),
    ]
    for scale in (1, 2)
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model, one timed round, fewer configs")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--comm", action="store_true", help="only table 3: FSDP traffic per step, compiled only")
    return parser.parse_args()


def build(dim: int, hidden: int, depth: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, hidden)
            self.down = nn.Linear(hidden, dim)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    return Stack()


def mse(model, batch):
    x, y = batch
    return (model(x) - y).square().mean()


def device_bytes(arrays) -> int:
    """The most bytes any one device holds of these arrays."""
    per: dict[object, int] = {}
    for array in arrays:
        for shard in array.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


def trainer_for(config: Config, args: argparse.Namespace):
    import jax
    import optax

    model = build(args.dim, args.hidden, args.depth)
    data = config.devices // max(config.stages, 1)
    axes = ({"stage": config.stages} if config.stages else {}) | ({"data": data} if data > 1 else {})
    mesh = ts.make_mesh(axes, devices=jax.devices()[: config.devices])
    plan = ts.plan(model, mesh, ts.presets.data_parallel())
    pipeline = (
        ts.Pipeline(microbatches=args.microbatches * config.scale, schedule=config.schedule, repeats=config.repeats)
        if config.stages
        else None
    )
    return ts.Trainer(model, mse, optax.adamw(1e-4), plan, pipeline=pipeline, remat=r"blocks\.\d+" if config.remat
                      else None, batch_spec=("data",) if data > 1 else ())  # fmt: skip


def measure(configs: list[Config], args: argparse.Namespace, batch: Any) -> list[dict[str, Any]]:
    """One row per config: memory from the compiled step, then median wall and CPU time over interleaved rounds."""
    import jax

    trainers, placed, rows = {}, {}, {}
    for config in configs:
        trainer = trainers[config.name] = trainer_for(config, args)
        rows_batch = tuple(x.repeat(config.scale, *([1] * (x.ndim - 1))) for x in batch)
        placed[config.name] = trainer.place_batch(rows_batch)
        memory = trainer.lower(rows_batch).compile().memory_analysis()
        rows[config.name] = {
            "config": config.name,
            "mesh": "×".join(f"{k}={v}" for k, v in trainer.mesh.shape.items()),
            "microbatches": args.microbatches * config.scale if config.stages else None,
            "stages": config.stages,
            "repeats": config.repeats,
            "param_bytes": device_bytes(jax.tree.leaves(trainer.state.params)),
            "argument_bytes": memory.argument_size_in_bytes,
            "temp_bytes": memory.temp_size_in_bytes,
            "bubble": trainer.idle_fraction,
        }
        jax.block_until_ready(trainer.step(placed[config.name])["loss"])  # compile and warm up
        print(f"built {config.name}", flush=True)
    wall: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    for r in range(args.rounds):
        for name, trainer in trainers.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(trainer.step(placed[name])["loss"])
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
        print(f"round {r + 1}/{args.rounds}", flush=True)
    for name, row in rows.items():
        row["step_ms"], row["cpu_ms"] = 1e3 * statistics.median(wall[name]), 1e3 * statistics.median(cpu[name])
    return list(rows.values())


def main() -> None:
    args = parse_args()
    if args.tiny:
        args.dim, args.hidden, args.batch, args.seq, args.microbatches, args.rounds = 32, 64, 32, 4, 4, 1
    ts.use_cpu_devices(8)
    import torch

    g = torch.Generator().manual_seed(1)
    shape = (args.batch, args.seq, args.dim)
    batch = (torch.randn(*shape, generator=g), torch.randn(*shape, generator=g))
    if args.comm:
        rows = communication(args, batch)
        print_communication(rows, f"{args.depth} blocks {args.dim}→{args.hidden}→{args.dim}, batch {args.batch}×"
                                  f"{args.seq}, fsdp('data'), AdamW, M={args.microbatches}")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "communication": rows}, f, indent=1)
        return
    # --tiny keeps the smoke test's rows: the unpipelined baseline, two schedules and the 4-stage bubbles
    memory = measure([c for c in MEMORY if c.name in TINY_MEMORY] if args.tiny else MEMORY, args, batch)
    bubble = measure([c for c in BUBBLE if c.stages == 4] if args.tiny else BUBBLE, args, batch)
    for row in memory:
        row["param_ratio"] = row["param_bytes"] / memory[0]["param_bytes"]
        row["argument_ratio"] = row["argument_bytes"] / memory[0]["argument_bytes"]
        gpipe = next((r for r in memory if r["config"] == f"gpipe S={row['stages']}"), None)
        row["temp_vs_gpipe"] = row["temp_bytes"] / gpipe["temp_bytes"] if gpipe and row["stages"] else None
    bubble = measured_bubbles(bubble)
    head = f"{args.depth} blocks {args.dim}→{args.hidden}→{args.dim}, batch {args.batch}×{args.seq}, AdamW"
    print_memory(memory, head)
    print_bubble(bubble, head, args.microbatches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "memory": memory, "bubble": bubble}, f, indent=1)


# the first row is the baseline of the traffic ratio (the same mesh and plan), the second of the FLOPs ratio:
# the useful FLOPs per device (on stage=4 × data=2 unpipelined, the 4 stage replicas each compute half the batch)
COMM = [("unpipelined", None, 1), ("unpipelined data=8", None, 1), ("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1),
        ("1f1b_remat", "1f1b_remat", 1), ("circular r=2", "circular", 2),
        ("zero_bubble", "zero_bubble", 1)]  # fmt: skip


def communication(args: argparse.Namespace, batch: Any) -> list[dict[str, Any]]:
    """Table 3: per schedule, bytes per step over each axis group, temp and FLOPs, from the compiled step."""
    import optax

    from torchshard._hlo.costs import step_costs
    from torchshard.inspect import collectives

    rows = []
    for name, schedule, repeats in COMM:
        model = build(args.dim, args.hidden, args.depth)
        mesh = ts.make_mesh({"data": 8} if name.endswith("data=8") else {"stage": 4, "data": 2})
        plan = ts.plan(model, mesh, ts.presets.fsdp(min_size=1024))
        pipeline = ts.Pipeline(microbatches=args.microbatches, schedule=schedule, repeats=repeats) if schedule else None
        trainer = ts.Trainer(model, mse, optax.adamw(1e-4), plan, pipeline=pipeline, batch_spec=("data",))
        compiled = trainer.lower(batch).compile()
        per_axes = collectives(compiled, mesh=mesh).per_axes
        costs = step_costs(str(compiled.as_text()))
        rows.append({"config": name, "per_axes": per_axes, "off_stage": sum(n for k, n in per_axes.items()
                     if k != "stage"), "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                     "flops": costs.flops, "recompute_flops": costs.recompute_flops,
                     "bubble": trainer.idle_fraction if schedule else None})  # fmt: skip
        print(f"compiled {name}", flush=True)
    useful, gpipe = rows[1]["flops"], next(r for r in rows if r["config"] == "gpipe")
    one_f_one_b = next(r for r in rows if r["config"] == "1f1b")
    for row in rows:
        row["compiled_bubble"] = compiled_bubble(row, useful) if row["bubble"] is not None else None
        row["flops_vs_gpipe"] = row["flops"] / gpipe["flops"]
        row["temp_vs_gpipe"] = row["temp_bytes"] / gpipe["temp_bytes"]
        row["temp_vs_1f1b"] = row["temp_bytes"] / one_f_one_b["temp_bytes"]
        row["wasted_vs_gpipe"] = wasted(row, useful) / wasted(gpipe, useful) if row["bubble"] is not None else None
    return rows


def wasted(row: dict[str, Any], useful: float) -> float:
    """The FLOPs per device of the bubble's placeholder micro-batches: FLOPs - recomputed - useful."""
    return row["flops"] - row["recompute_flops"] - useful


def compiled_bubble(row: dict[str, Any], useful: float) -> float:
    """The share of a pipelined step's FLOPs spent on the bubble's placeholder micro-batches, from the compiled
    program: 1 - useful ÷ (FLOPs - recomputed FLOPs), ``useful`` being the unpipelined step's per device on as
    many devices (each device of stage=S × data=D holds 1/S of the layers for 1/D of the rows)."""
    return 1 - useful / (row["flops"] - row["recompute_flops"])


def print_communication(rows: list[dict[str, Any]], head: str) -> None:
    mib, base, useful = 2**20, rows[0], rows[1]
    print(f"\n{head}, mesh stage=4 × data=2 (but the data=8 row), 8 CPU devices, compiled only\n")
    print("| config | bytes/step over data (MiB) | over stage,data | over stage | non-stage ÷ unpipelined | "
          "temp (MiB) | temp ÷ gpipe | GFLOP/step | ÷ useful (data=8) | ÷ gpipe | recomputed share | "
          "bubble (formula) | bubble (compiled FLOPs) | wasted FLOPs ÷ gpipe's | temp ÷ 1f1b |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        over = lambda k: r["per_axes"].get(k, 0) / mib  # noqa: E731
        bubbles = ("– | – | –" if r["bubble"] is None else
                   f"{r['bubble']:.3f} | {r['compiled_bubble']:.3f} | {r['wasted_vs_gpipe']:.2f}")  # fmt: skip
        print(f"| {r['config']} | {over('data'):.2f} | {over('stage,data'):.2f} | {over('stage'):.2f} | "
              f"{r['off_stage'] / base['off_stage']:.2f} | {r['temp_bytes'] / mib:.1f} | {r['temp_vs_gpipe']:.2f} | "
              f"{r['flops'] / 1e9:.2f} | {r['flops'] / useful['flops']:.2f} | {r['flops_vs_gpipe']:.2f} | "
              f"{r['recompute_flops'] / r['flops']:.2f} | {bubbles} | {r['temp_vs_1f1b']:.2f} |")  # fmt: skip


def measured_bubbles(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The M-micro-batch rows, each with the bubble its ×2 twin measures (see the module docstring)."""
    twins = {r["config"]: r for r in rows}
    found = []
    for row in rows:
        if row["config"].endswith(" ×2"):
            continue
        twice = twins[row["config"] + " ×2"]
        per_iteration = (twice["cpu_ms"] - row["cpu_ms"]) / (row["repeats"] * row["microbatches"])
        found.append(row | {"iteration_ms": per_iteration,
                            "measured_bubble": (row["stages"] - 1) * per_iteration / row["cpu_ms"]})  # fmt: skip
    return found


def print_memory(rows: list[dict[str, Any]], head: str) -> None:
    mib = 2**20
    print(f"\n{head}, 8 CPU devices\n")
    print("| config | mesh | params/device (MiB) | ÷ unpipelined | argument bytes/device (MiB) | ÷ unpipelined | "
          "temp (MiB) | temp ÷ gpipe | step wall (ms) | step CPU (ms) | bubble (formula) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        formula = "–" if r["microbatches"] is None else f"{r['bubble']:.3f}"
        versus = "–" if r["temp_vs_gpipe"] is None else f"{r['temp_vs_gpipe']:.2f}"
        print(
            f"| {r['config']} | {r['mesh']} | {r['param_bytes'] / mib:.2f} | {r['param_ratio']:.2f} | "
            f"{r['argument_bytes'] / mib:.2f} | {r['argument_ratio']:.2f} | {r['temp_bytes'] / mib:.2f} | {versus} | "
            f"{r['step_ms']:.0f} | {r['cpu_ms']:.0f} | {formula} |"
        )


def print_bubble(rows: list[dict[str, Any]], head: str, microbatches: int) -> None:
    print(f"\n{head}, M={microbatches} micro-batches, remat per block, the stage axis alone\n")
    print("| config | mesh | step CPU (ms) | one iteration (ms) | bubble (formula) | bubble (measured) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['mesh']} | {r['cpu_ms']:.0f} | {r['iteration_ms']:.1f} | {r['bubble']:.3f} | "
              f"{r['measured_bubble']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
