"""Checkpoint throughput against the disk's own speed, where a save's time goes, and what a save costs a training loop.

A 6-layer MLP of width 2048 (25.2M parameters) with AdamW, FSDP over 8 simulated CPU devices:
about 300 MB of state. The baseline, in the same run and on the same directory, writes a file of
the same size and fsyncs it (and reads it back, for `load`). Rounds are interleaved so that load
drifts on a shared machine hit every side alike; each number is a median.

* save / load: ``ts.save`` (synchronous) and ``ts.load`` against the baseline file. A load must put
  the bytes in new memory (the devices' buffers), which a read into a reused buffer does not: the
  same read into new memory (``np.fromfile``) is timed too. Loads and
  baseline reads run twice: "cold", after ``posix_fadvise(DONTNEED)`` dropped the files from the
  page cache (the disk's read speed), and "warm" (from the page cache, as right after a save).
* breakdown: the phases inside real saves and loads (the private functions they call, timed in
  place), and parts timed alone: the checksums, orbax's write of the same state (the format
  before torchshard wrote its own shard files), the device copy a background save takes.
* stall: a loop that reads each step's loss; the extra time of the iteration that calls
  ``ts.save`` (synchronous or ``background=True``), in step times.

    python benchmarks/checkpoint.py          # the README's numbers
    python benchmarks/checkpoint.py --tiny   # seconds; what the smoke test runs
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a width-256 model and two rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--json", help="also write the results here")
    return parser.parse_args()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def disk_write(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def disk_read(path: pathlib.Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def uncached(*paths: pathlib.Path) -> None:
    """Drops the files under ``paths`` from the page cache (they were fsynced, so no page is dirty)."""
    for path in paths:
        for file in [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Phases:
    """Wraps functions that ``ts.save`` calls (private, by name) to time its phases inside real saves."""

    def __init__(self, module: Any, names: list[str]) -> None:
        self.times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            setattr(module, name, self._timed(name, getattr(module, name)))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[name].append(time.perf_counter() - start)

        return run


def main() -> None:
    args = parse_args()
    rounds = 2 if args.tiny else args.rounds
    width = 256 if args.tiny else 2048
    import torchshard as ts

    ts.use_cpu_devices(8)
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    import torch

    from torchshard._ckpt import checkpoint as _checkpoint  # private: the parts of a save and a load, timed
    from torchshard._ckpt import load as _load
    from torchshard._ckpt import shards as _shards
    from torchshard._ckpt.checksum import checksums
    from torchshard._ckpt.state import state_tree

    saving = ["_snapshot", "_begin", "write_state", "finish_checksums", "write_meta", "_finish"]
    loading = ["read_meta", "check_files", "read_state", "checksum_problems", "destination_arrays", "load_trainer"]
    phases = Phases(_checkpoint, saving)
    phases.times |= Phases(_load, loading).times  # ts.load's parts, in _ckpt/load.py
    writes = Phases(_shards, ["_write_file", "_write_all"])  # a file per save; _write_all per shard (summed)
    fsyncs = Phases(_shards.os, ["fsync"])  # every fsync of the process; counted only inside ts.save below

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(6)))
    plan = ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=0))
    trainer = ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.adamw(1e-3), plan)
    batch = torch.randn(64, width)

    def step() -> None:
        float(trainer.step(batch)["loss"])

    for _ in range(3):
        step()
    tree = state_tree(trainer, doing="benchmark")
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    work = pathlib.Path(tempfile.mkdtemp(dir=args.dir))
    data = os.urandom(nbytes)

    def orbax_write(compress: bool) -> None:
        target = pathlib.Path(tempfile.mkdtemp(dir=work)) / "state"
        handler = ocp.PyTreeCheckpointHandler(use_compression=compress)
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(target, args=ocp.args.PyTreeSave(tree))
        shutil.rmtree(target.parent)

    def save() -> None:
        before = len(fsyncs.times["fsync"])
        ts.save(work / "ckpt", trainer, keep_last=1)
        fsync_s.append(sum(fsyncs.times["fsync"][before:]))

    fsync_s: list[float] = []
    parts: dict[str, Callable[[], Any]] = {
        "baseline write+fsync": lambda: disk_write(work / "baseline", data),
        "ts.save": save,
        "baseline read, cold": lambda: (uncached(work / "baseline"), disk_read(work / "baseline")),
        "baseline read into new memory, cold": lambda: (
            uncached(work / "baseline"),
            np.fromfile(work / "baseline", np.uint8),
        ),
        "ts.load, cold": lambda: (uncached(work / "ckpt"), ts.load(work / "ckpt", trainer)),
        "baseline read, warm": lambda: disk_read(work / "baseline"),
        "ts.load, warm": lambda: ts.load(work / "ckpt", trainer),
        "checksums alone": lambda: checksums(tree),
        "orbax write, uncompressed (previous format)": lambda: orbax_write(False),
        "device copy (background snapshot)": lambda: jax.block_until_ready(jax.device_put(tree, may_alias=False)),
    }
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(rounds):
        for name, part in parts.items():
            times[name].append(timed(part))
    median = {name: statistics.median(t) for name, t in times.items()}
    inside = {name: statistics.median(t) for name, t in phases.times.items()}
    inside["data write (os.write, per save)"] = sum(writes.times["_write_all"]) / rounds
    inside["fsync (per save)"] = statistics.median(fsync_s)
    inside["_write_file (write + fsync)"] = statistics.median(writes.times["_write_file"])
    load_avg = os.getloadavg()
    stall = measure_stall(ts, trainer, step, work, rounds=rounds)
    shutil.rmtree(work)
    report(nbytes, median, inside, stall, args.json, load_avg)


def measure_stall(ts: Any, trainer: Any, step: Callable[[], None], work: pathlib.Path, *, rounds: int) -> dict:
    """Step times alone, and the extra time of a step whose iteration starts a save, in step times."""
    plain, sync, background = [], [], []
    for _ in range(rounds):
        plain += [timed(step) for _ in range(3)]
        sync.append(timed(lambda: (ts.save(work / "stall", trainer, keep_last=1), step())))
        for _ in range(2):
            plain.append(timed(step))
        future: list[Any] = []
        background.append(timed(lambda: (future.append(ts.save(work / "stall", trainer, keep_last=1,
                                                               background=True)), step())))  # fmt: skip
        plain.append(timed(step))  # the next step runs while the save writes
        future[0].result()
    step_s = statistics.median(plain)
    extra = {"sync": statistics.median(sync) - step_s, "background": statistics.median(background) - step_s}
    return {"step_s": step_s, **{k: {"extra_s": v, "steps": v / step_s} for k, v in extra.items()}}


def report(
    nbytes: int, median: dict[str, float], inside: dict[str, float], stall: dict, out: str | None, load: Any
) -> None:
    base_w, base_r = median["baseline write+fsync"], median["baseline read, cold"]
    print(f"state: {nbytes / 1e6:.1f} MB; disk: {nbytes / base_w / 1e6:.0f} MB/s write+fsync, "
          f"{nbytes / base_r / 1e6:.0f} MB/s read uncached (baseline, same run); load average {load}\n")  # fmt: skip
    print("| what | median (s) | MB/s | vs baseline |\n|---|---|---|---|")
    for name, seconds in median.items():
        base = base_w
        if "read" in name or "load" in name:
            base = median["baseline read, warm" if name.endswith("warm") else "baseline read, cold"]
        if name.startswith("baseline read into"):
            base = median["baseline read, cold"]
        print(f"| {name} | {seconds:.3f} | {nbytes / seconds / 1e6:.0f} | {base / seconds:.2f}× |")
    print("\n| phase inside ts.save / ts.load | median (s) |\n|---|---|")
    for name, seconds in inside.items():
        print(f"| {name} | {seconds:.3f} |")
    print(f"\nstep: {stall['step_s'] * 1e3:.0f} ms")
    print("| save in the loop | extra time (s) | in step times |\n|---|---|---|")
    for kind in ("sync", "background"):
        print(f"| {kind} | {stall[kind]['extra_s']:.3f} | {stall[kind]['steps']:.2f} |")
    if out:
        result = {"bytes": nbytes, "median_s": median, "phases_s": inside, "stall": stall, "load_average": load,
                  "save_vs_disk": base_w / median["ts.save"], "load_vs_disk": base_r / median["ts.load, cold"],
                  "warm_load_vs_read": median["baseline read, warm"] / median["ts.load, warm"]}  # fmt: skip
        pathlib.Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
