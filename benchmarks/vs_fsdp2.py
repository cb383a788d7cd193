"""torchshard against PyTorch FSDP2 and DTensor tensor parallelism (8 gloo CPU ranks) on the same MLP and Llama.

Each workload (MLP 784-1024-1024-1024-10, batch 2048; a 4-layer Llama, batch 16 × seq 256; AdamW;
FSDP over 8 and FSDP 4 × TP 2) is timed in rounds: torchshard runs ``--steps`` steps in this
process on 8 simulated CPU devices, then 8 torch ranks run as many. The torch ranks are their own
processes (gloo, one thread each; one child imports torch once and forks the other 7), started
once and kept waiting for a command between rounds: eager torch timed in a process that also runs
JAX is meaningless, as the thread pools fight. Startup, compilation and warm-up are not timed.
The torch side is ``fully_shard`` per block and at the root; for FSDP×TP, ``parallelize_module``
on the "tp" dim of a 4×2 mesh first (the model's ``tp_plan`` for the Llama, alternating
colwise/rowwise for the MLP) and ``fully_shard`` on "dp". A torch step's time is the slowest rank's.

Memory: params + AdamW state per rank (torch, local shards) and per device (torchshard); the
peak is, for torch, those plus the step's resident-set high-water mark above the resting RSS
(Linux ``clear_refs``), and for torchshard the compiled step's footprint per device from
``memory_analysis()`` (arguments + outputs − donated aliases + temporaries).

Run::

    python benchmarks/vs_fsdp2.py --tiny                     # smoke: tiny sizes, 2 rounds of 2 steps
    python benchmarks/vs_fsdp2.py --rounds 2                 # the issue's MLP and Llama
    python benchmarks/vs_fsdp2.py --workloads mlp --rounds 5 --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import Any

WORLD = 8
LAYOUTS = {"fsdp": "FSDP 8", "fsdp_tp": "FSDP×TP 4×2"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    mlp: tuple[int, ...]
    mlp_batch: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    seq: int
    llama_batch: int


FULL = Sizes((784, 1024, 1024, 1024, 10), 2048, hidden=512, intermediate=1376, layers=4, heads=8, vocab=8000,
             seq=256, llama_batch=16)  # fmt: skip
TINY = Sizes((32, 64, 10), 64, hidden=64, intermediate=128, layers=2, heads=4, vocab=128, seq=16, llama_batch=8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, 2 rounds of 2 steps (smoke test)")
    parser.add_argument("--workloads", default="mlp,llama", help="comma list of mlp, llama")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; --tiny 2)")
    parser.add_argument("--steps", type=int, help="timed steps per side per round (default 5; --tiny 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps before the first round (default 2; --tiny 1)")
    parser.add_argument("--torch-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = (2, 2, 1) if args.tiny else (3, 5, 2)
    for name, default in zip(("rounds", "steps", "warmup"), defaults, strict=True):
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    args.warmup = max(1, args.warmup)  # the first step creates the AdamW state that is measured
    return args


def workloads_of(args: argparse.Namespace) -> list[tuple[str, str]]:
    kinds = [k for k in args.workloads.split(",") if k]
    unknown = sorted(set(kinds) - {"mlp", "llama"})
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; use a comma list of mlp, llama")
    return [(kind, layout) for kind in kinds for layout in LAYOUTS]


def label(kind: str, layout: str) -> str:
    return f"{'MLP' if kind == 'mlp' else 'Llama'} {LAYOUTS[layout]}"


# --- the shared workload: model, batch, loss -------------------------------------------------------------------------


def build(kind: str, sizes: Sizes) -> Any:
    import torch

    torch.manual_seed(0)
    if kind == "mlp":
        return build_mlp(sizes.mlp)
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=sizes.hidden, intermediate_size=sizes.intermediate, num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads, num_key_value_heads=sizes.heads, vocab_size=sizes.vocab,
        max_position_embeddings=sizes.seq, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def build_mlp(widths: tuple[int, ...]) -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def mlp_tp_names(widths: tuple[int, ...]) -> tuple[list[str], list[str]]:
    """Megatron-style MLP tensor parallelism: the Linears alternate colwise, rowwise."""
    linears = [str(2 * i) for i in range(len(widths) - 1)]
    return linears[0::2], linears[1::2]


def batch_of(kind: str, sizes: Sizes) -> tuple[Any, ...]:
    import torch

    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        n = sizes.mlp_batch
        return torch.randn(n, sizes.mlp[0], generator=g), torch.randint(0, sizes.mlp[-1], (n,), generator=g)
    return (torch.randint(0, sizes.vocab, (sizes.llama_batch, sizes.seq), generator=g),)


def mlp_loss(model: Any, batch: tuple[Any, ...]) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(model(batch[0]), batch[1])


def llama_loss(model: Any, batch: tuple[Any, ...]) -> Any:
    return model(input_ids=batch[0], labels=batch[0]).loss


LOSSES = {"mlp": mlp_loss, "llama": llama_loss}


# --- the torch side: one process per rank ----------------------------------------------------------------------------


def torch_tp_plan(kind: str, model: Any, sizes: Sizes) -> dict[str, Any]:
    """parallelize_module's plan: the MLP's alternating Linears, or the Llama's own ``tp_plan``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if kind == "mlp":
        colwise, rowwise = mlp_tp_names(sizes.mlp)
        return {**{n: ColwiseParallel() for n in colwise}, **{n: RowwiseParallel() for n in rowwise}}
    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    return {name: styles[style]() for name, style in model.tp_plan.items()}


def shard_torch(kind: str, layout: str, model: Any, sizes: Sizes) -> tuple[int, int]:
    """Applies TP (FSDP×TP only) then FSDP2 in place; returns this rank's batch slice (index, count)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], torch_tp_plan(kind, model, sizes))
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    blocks = model.model.layers if kind == "llama" else [m for m in model if hasattr(m, "weight")]
    for block in blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return dp.get_local_rank(), dp.size()


def local_nbytes(tensors: Iterable[Any]) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


@dataclasses.dataclass(frozen=True)
class TorchJob:
    step: Callable[[], None]
    state_bytes: Callable[[], int]  # params + AdamW state on this rank


def torch_job(kind: str, layout: str, sizes: Sizes) -> TorchJob:
    import torch

    model = build(kind, sizes)
    index, count = shard_torch(kind, layout, model, sizes)
    batch = tuple(t.chunk(count)[index] for t in batch_of(kind, sizes))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss = LOSSES[kind]

    def step() -> None:
        loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state_bytes() -> int:
        moments = (v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        return local_nbytes(itertools.chain(model.parameters(), moments))

    return TorchJob(step, state_bytes)


def proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> bool:
    """Returns the heap's free pages to the OS and restarts the RSS high-water mark; False where Linux can't."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def all_max(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def torch_round(job: TorchJob, steps: int) -> dict[str, Any]:
    """``steps`` timed steps, each started together; each time and the RSS above rest are the slowest rank's."""
    import torch.distributed as dist

    measured = reset_peak_rss()
    rest = proc_status_bytes("VmRSS")
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        job.step()
        times.append(time.perf_counter() - start)
    above = proc_status_bytes("VmHWM") - rest if measured else -1.0
    *times, above = all_max([*times, above])
    return {"times": times, "rss_above_rest": above if above >= 0 else None}


def next_command(rank: int) -> int:
    """Rank 0 reads a workload index (or -1: stop) from its stdin and tells the others."""
    import torch
    import torch.distributed as dist

    command = torch.tensor([int(sys.stdin.readline() or -1) if rank == 0 else 0])
    dist.broadcast(command, src=0)
    return int(command.item())


def torch_main(args: argparse.Namespace) -> int:
    """Imports torch (and transformers) once, then forks the other ranks; this process is rank 0."""
    import torch  # noqa: F401

    if "llama" in args.workloads:
        import transformers  # noqa: F401

    warnings.filterwarnings("ignore")  # FSDP2's view warnings and transformers', eight times over
    children = []
    for rank in range(1, WORLD):
        pid = os.fork()
        if pid == 0:
            os._exit(run_rank(args, rank))
        children.append(pid)
    code = run_rank(args, 0)
    return max([code] + [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children])


def run_rank(args: argparse.Namespace, rank: int) -> int:
    try:
        return rank_main(args, rank)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1


def rank_main(args: argparse.Namespace, rank: int) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(hours=2)  # the ranks wait while torchshard compiles and runs
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=WORLD,
                            timeout=timeout)  # fmt: skip
    sizes = TINY if args.tiny else FULL
    jobs = [torch_job(kind, layout, sizes) for kind, layout in workloads_of(args)]
    for job in jobs:
        for _ in range(args.warmup):
            job.step()
    state = all_max([float(job.state_bytes()) for job in jobs])
    respond = (lambda d: print(json.dumps(d), flush=True)) if rank == 0 else (lambda d: None)
    respond({"ready": True, "state_bytes": state})
    while (command := next_command(rank)) >= 0:
        respond(torch_round(jobs[command], args.steps))
    dist.destroy_process_group()
    return 0


# --- the parent: torchshard in process, the torch ranks as children --------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_torch(args: argparse.Namespace) -> subprocess.Popen:
    """The torch job: rank 0 answers on stdout, the other ranks are its forks."""
    argv = [sys.executable, __file__, "--torch-job", "--port", str(free_port()), "--workloads", args.workloads,
            "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--tiny"] if args.tiny else [])  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def read_reply(job: subprocess.Popen) -> dict[str, Any]:
    """The next JSON line from rank 0 (other lines on its stdout are skipped)."""
    assert job.stdout is not None
    for line in job.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the torch job stopped answering (exit code {job.wait()}; its stderr is above)")


def ask(job: subprocess.Popen, command: int) -> dict[str, Any]:
    assert job.stdin is not None
    job.stdin.write(f"{command}\n")
    job.stdin.flush()
    return read_reply(job) if command >= 0 else {}


def stop(job: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        ask(job, -1)
    try:
        job.wait(timeout=60)
    except subprocess.TimeoutExpired:
        job.kill()  # its forked ranks then fail on the lost peer and exit
        job.wait()
    for pipe in (job.stdin, job.stdout):  # the command and reply pipes
        if pipe is not None:
            pipe.close()


def ts_rules(kind: str, layout: str, model: Any, sizes: Sizes) -> Any:
    import torchshard as ts

    if kind == "llama":
        return ts.presets.hf_rules(model, axis=None if layout == "fsdp" else "model")
    if layout == "fsdp":
        return ts.presets.fsdp()
    colwise, rowwise = mlp_tp_names(sizes.mlp)
    return ts.presets.tensor_parallel(colwise=colwise, rowwise=rowwise) + ts.presets.fsdp()


def per_device_bytes(trainer: Any) -> int:
    """Largest bytes held on one device by params and optimizer state."""
    import jax

    totals: dict[Any, int] = {}
    for leaf in jax.tree.leaves((trainer.state.params, trainer.state.opt_state)):
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return max(totals.values())


def compiled_bytes(trainer: Any, batch: tuple[Any, ...]) -> int | None:
    """Per-device footprint of the compiled step: arguments + outputs − donated aliases + temporaries."""
    m = trainer.lower(batch).compile().memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


@dataclasses.dataclass(frozen=True)
class TsJob:
    step: Callable[[], Any]
    state_bytes: int
    peak_bytes: int | None


def ts_job(kind: str, layout: str, sizes: Sizes, warmup: int) -> TsJob:
    import jax
    import optax

    import torchshard as ts

    model = build(kind, sizes)
    mesh = ts.make_mesh({"data": WORLD} if layout == "fsdp" else {"data": WORLD // 2, "model": 2})
    plan = ts.plan(model, mesh, ts_rules(kind, layout, model, sizes))
    trainer = ts.Trainer(model, LOSSES[kind], optax.adamw(1e-3, weight_decay=0.01), plan)
    batch = batch_of(kind, sizes)
    peak = compiled_bytes(trainer, batch)
    placed = trainer.place_batch(batch)
    step = lambda: trainer.step(placed)["loss"]  # noqa: E731
    for _ in range(warmup):
        jax.block_until_ready(step())
    return TsJob(step, per_device_bytes(trainer), peak)


def ts_round(job: TsJob, steps: int) -> list[float]:
    import jax

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(job.step())
        times.append(time.perf_counter() - start)
    return times


def compare(args: argparse.Namespace, job: subprocess.Popen) -> list[dict[str, Any]]:
    """Builds and warms up both sides, then times them in interleaved rounds."""
    sizes = TINY if args.tiny else FULL
    loads = workloads_of(args)
    start = time.perf_counter()
    ts_jobs = [ts_job(kind, layout, sizes, args.warmup) for kind, layout in loads]
    print(f"torchshard compiled and warmed up in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    ready = read_reply(job)
    print(f"torch ranks ready after {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    ts_times: list[list[float]] = [[] for _ in loads]
    torch_rounds: list[list[dict[str, Any]]] = [[] for _ in loads]
    for r in range(args.rounds):
        for i, ts_side in enumerate(ts_jobs):
            ts_times[i] += ts_round(ts_side, args.steps)
            torch_rounds[i].append(ask(job, i))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return [row(label(*w), t, j, rounds, state) for w, t, j, rounds, state
            in zip(loads, ts_times, ts_jobs, torch_rounds, ready["state_bytes"], strict=True)]  # fmt: skip


def row(name: str, ts_times: list[float], job: TsJob, rounds: list[dict[str, Any]], state: float) -> dict[str, Any]:
    above = [r["rss_above_rest"] for r in rounds if r["rss_above_rest"] is not None]
    return {
        "workload": name,
        "torchshard_s": statistics.median(ts_times),
        "torch_s": statistics.median(t for r in rounds for t in r["times"]),
        "torch_state": state,
        "torch_peak": state + max(above) if above else None,
        "ts_state": job.state_bytes,
        "ts_peak": job.peak_bytes,
    }


def mib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**20:.2f}"


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | torchshard s/step | FSDP2/DTensor s/step | FSDP2 ÷ torchshard | params+AdamW MiB/rank (torch) "
        "| params+AdamW MiB/device (torchshard) | peak MiB/rank (torch) | peak MiB/device (torchshard) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["workload"], f"{r['torchshard_s']:.4f}", f"{r['torch_s']:.4f}",
                 f"{r['torch_s'] / r['torchshard_s']:.2f}×", mib(r["torch_state"]), mib(r["ts_state"]),
                 mib(r["torch_peak"]), mib(r["ts_peak"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_job:
        return torch_main(args)
    workloads_of(args)  # fail on a bad list before starting anything
    job = launch_torch(args)  # first: the ranks import and warm up while torchshard compiles
    try:
        import torchshard as ts

        ts.use_cpu_devices(WORLD)
        rows = compare(args, job)
    finally:
        stop(job)
    sizes = TINY if args.tiny else FULL
    print(f"{sizes}; AdamW; {args.rounds} rounds × {args.steps} steps per side, medians; "
          f"load average {os.getloadavg()[0]:.2f}\n")  # fmt: skip
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
