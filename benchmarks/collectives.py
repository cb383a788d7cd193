"""Times torchshard.collectives over a range of message sizes: time, algorithmic and bus bandwidth, and a plot.

Bandwidths follow the nccl-tests convention (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): ``size`` is
the bytes each device holds of the full message (all_gather: its output; psum_scatter: its input),
``algbw = size / time`` and ``busbw = algbw × factor``, with factor (n-1)/n for all_gather, psum_scatter
and all_to_all, 2(n-1)/n for psum (all-reduce) and 1 for ppermute, so that busbw compares with the
hardware's link bandwidth whatever the op.

Run:
    python benchmarks/collectives.py                       # all local devices (8 simulated CPUs without an accelerator)
    python benchmarks/collectives.py --sizes 1M,16M,256M --iters 20 --plot collectives.png
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torchshard as ts

ts.use_cpu_devices(8)  # only shapes the CPU backend: on a GPU/TPU machine the accelerator is still used

import jax  # noqa: E402
import torch  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from torchshard import collectives as C  # noqa: E402

AXIS = "data"
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


@dataclasses.dataclass(frozen=True)
class Op:
    """One collective: how to build its shard_map, its global input shape, and its nccl-tests busbw factor."""

    name: str
    fn: Callable[[torch.Tensor, int], torch.Tensor]
    in_spec: P
    out_spec: P
    global_shape: Callable[[int, int], tuple[int, ...]]  # (elements per device, n) → input shape
    bus_factor: Callable[[int], float]


def _ring(x: torch.Tensor, n: int) -> torch.Tensor:
    return C.ppermute(x, AXIS, [(i, (i + 1) % n) for i in range(n)])


OPS = (
    Op("all_gather", lambda x, n: C.all_gather(x, AXIS, tiled=True), P(AXIS), P(),
       lambda e, n: (e,), lambda n: (n - 1) / n),
    Op("psum", lambda x, n: C.psum(x, AXIS), P(AXIS), P(), lambda e, n: (n * e,), lambda n: 2 * (n - 1) / n),
    Op("psum_scatter", lambda x, n: C.psum_scatter(x, AXIS, tiled=True), P(AXIS), P(AXIS),
       lambda e, n: (n * e,), lambda n: (n - 1) / n),
    Op("all_to_all", lambda x, n: C.all_to_all(x, AXIS, 0, 0, tiled=True), P(AXIS, None), P(AXIS, None),
       lambda e, n: (n * n, e // n), lambda n: (n - 1) / n),
    Op("ppermute", _ring, P(AXIS), P(AXIS), lambda e, n: (n * e,), lambda n: 1.0),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Result:
    op: str
    devices: int
    size_bytes: int
    seconds: float
    algbw: float
    busbw: float


def parse_size(text: str) -> int:
    """``"64K"`` → 65536 (binary units K, M, G; plain numbers are bytes)."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text.removesuffix(unit)) * UNITS[unit])


def elements_per_device(size_bytes: int, n: int) -> int:
    """float32 elements per device: a multiple of n² so every op splits evenly, at least n²."""
    return max(1, size_bytes // 4 // (n * n)) * n * n


def time_op(op: Op, mesh: jax.sharding.Mesh, size_bytes: int, *, iters: int) -> Result:
    n = mesh.size
    elements = elements_per_device(size_bytes, n)
    fn = C.shard_map(lambda x: op.fn(x, n), mesh=mesh, in_specs=op.in_spec, out_specs=op.out_spec)
    x = C.shard_map(lambda t: t, mesh=mesh, in_specs=op.in_spec, out_specs=op.in_spec)(
        torch.randn(op.global_shape(elements, n))
    )
    fn(x).jax().block_until_ready()  # compile
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(x).jax().block_until_ready()  # sync every call: queuing many collectives unsynced aborts XLA on CPU
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    size = elements * 4
    return Result(op.name, n, size, seconds, size / seconds, size / seconds * op.bus_factor(n))


def _fmt_size(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit]:
            return f"{n / UNITS[unit]:g} {unit}iB"
    return f"{n} B"


def markdown(results: Sequence[Result]) -> str:
    lines = ["| op | devices | size/device | time (µs) | algbw (GB/s) | busbw (GB/s) |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r.op} | {r.devices} | {_fmt_size(r.size_bytes)} | {r.seconds * 1e6:.1f} | {r.algbw / 1e9:.4g} | "
        f"{r.busbw / 1e9:.4g} |"
        for r in results
    ]
    return "\n".join(lines)


def plot(results: Sequence[Result], path: str, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.op for r in results):
        rows = [r for r in results if r.op == name]
        ax.plot([r.size_bytes for r in rows], [r.busbw / 1e9 for r in rows], marker="o", label=name)
    ax.set(xscale="log", xlabel="bytes per device", ylabel="bus bandwidth (GB/s)", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="16K,256K,1M,4M", help="bytes per device, e.g. 1K,64K,1M (default: %(default)s)"
    )
    parser.add_argument("--iters", type=int, default=5, help="timed calls per op and size; the median is reported")
    parser.add_argument("--devices", type=int, default=None, help="use the first N devices (default: all)")
    parser.add_argument("--ops", default=",".join(op.name for op in OPS), help="comma-separated subset of ops")
    parser.add_argument("--plot", default="collectives.png", help="PNG path for the plot ('' to skip)")
    args = parser.parse_args(argv)
    devices = jax.devices()[: args.devices]
    mesh = ts.make_mesh({AXIS: len(devices)}, devices=devices)
    wanted = args.ops.split(",")
    ops = [op for op in OPS if op.name in wanted]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    results = [time_op(op, mesh, size, iters=args.iters) for op in ops for size in sizes]
    kind = f"{len(devices)} × {devices[0].device_kind}"
    print(f"collectives over {kind} (median of {args.iters} calls, each synced)\n")
    print(markdown(results))
    if args.plot:
        plot(results, args.plot, title=f"torchshard.collectives on {kind}")
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
