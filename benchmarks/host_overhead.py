"""Host time that ``Trainer.step`` adds on top of calling its compiled step on already placed inputs.

A model small enough that the step is mostly dispatch (a 6-layer MLP of width 64, batch 64 on 8
simulated devices): ``trainer.step(placed)`` against the jitted step function called directly on
the same placed batch (what the Trainer does minus its checks, batch placement of a placed batch,
rebinding the module's tensors, throttling and heartbeat). Each call waits for its result; the two
are interleaved, and the medians' difference is the overhead. A second pair times a CPU torch
batch: ``trainer.step(cpu_batch)`` against ``trainer.step(placed)`` (the cost of placing it).

    python benchmarks/host_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torchshard as ts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    ts.use_cpu_devices(8)
    import jax
    import optax
    import torch

    from torchshard._trainer.trainer import core_of

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))
    trainer = ts.Trainer(model, lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), optax.sgd(1e-3),
                         ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=0)))  # fmt: skip
    cpu = (torch.randn(64, 64), torch.randn(64, 64))
    placed = trainer.place_batch(cpu)

    def direct() -> None:
        # internal: the jitted step itself, on the Trainer's own state (the state is donated and replaced)
        core = core_of(trainer)
        core.state, metrics = core.step_fn(core.state, core.frozen, placed, core.base_key)
        jax.block_until_ready(metrics["loss"])

    calls = {
        "compiled step, placed batch": direct,
        "trainer.step(placed batch)": lambda: jax.block_until_ready(trainer.step(placed)["loss"]),
        "trainer.step(CPU torch batch)": lambda: jax.block_until_ready(trainer.step(cpu)["loss"]),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(20):
        for call in calls.values():
            call()
    for _ in range(args.calls):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    base = median["compiled step, placed batch"]
    print("| call | median (µs) | added (µs) |\n|---|---|---|")
    for name, value in median.items():
        print(f"| {name} | {1e6 * value:.0f} | {1e6 * (value - base):+.0f} |")


if __name__ == "__main__":
    main()
