"""Loading a torch.distributed.checkpoint: ``load_dcp`` into a meta model against ``dcp.load`` + ``shard``.

A Llama (0.87 GB of fp32 tensors; ``--tiny``: 0.4 MB) is saved three ways: ``single``, one chunk per
tensor (``dcp.save(model.state_dict())`` from one rank); ``sharded``, one chunk per device shard
(``ts.save_dcp`` from 8 devices under FSDP: rows, as an 8-rank FSDP2 save is laid out); ``as_loaded``,
``ts.save_dcp`` under the plan it is loaded onto. Loaded onto 8
simulated devices with ``hf_rules`` (data=4 × model=2), each path in a fresh process (``--tiny``:
both in the process that saved):

* ``dcp.load + shard``: the model is built on the host, ``dcp.load(model.state_dict())``, then ``shard``.
* ``load_dcp``: the model is built on ``meta`` and the checkpoint read into its plan.

Reported: the added peak host RSS (VmHWM reset just before the load, minus the RSS then) and the
wall time, medians of ``--repeats`` interleaved runs. Then 2 processes × 4 devices under
``torchshard.launch`` load each checkpoint (``--tiny``: all three in one launch): per process, the
bytes of stored chunks DCP read (its reader reads whole chunks) over the checkpoint's tensor bytes,
the bytes the process read from files (``rchar``), and its added peak RSS.

    python benchmarks/dcp.py [--tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)  # fmt: skip
FULL = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=10, num_attention_heads=16,
            num_key_value_heads=4, vocab_size=32000)  # fmt: skip


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1]) * 1024


def _rchar() -> int:
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


def _start_peak() -> int:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS
    return _status("VmRSS")


def _config(tiny: bool):
    import transformers

    return transformers.LlamaConfig(**(TINY if tiny else FULL), use_cache=False)


def _child(folder: str, how: str, tiny: bool) -> dict[str, float]:
    """One load in this process: added peak RSS, seconds, and (2-process runs) the bytes read."""
    import logging

    import torchshard as ts

    if how.startswith("bytes"):
        ts.distributed.initialize()
    else:
        ts.use_cpu_devices(8)
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers

    mesh, config = ts.make_mesh({"data": 4, "model": 2}), _config(tiny)
    with torch.device("meta"):
        rules = ts.presets.hf_rules(transformers.LlamaForCausalLM(config), fsdp_min_size=1024)
    read: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: read.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchshard").addHandler(handler)
    logging.getLogger("torchshard").setLevel(logging.INFO)
    path = str(Path(folder, {"bytes_sharded": "sharded", "bytes_as_loaded": "as_loaded"}.get(how, "single")))
    before, rchar, start = _start_peak(), _rchar(), time.perf_counter()
    if how == "dcp.load":
        model = transformers.LlamaForCausalLM(config)
        dcp.load(model.state_dict(), checkpoint_id=path, no_dist=True)
        ts.shard(model, ts.plan(model, mesh, rules))
    else:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        ts.load_dcp(path, model, ts.plan(model, mesh, rules))
    out = {"rss": float(_status("VmHWM") - before), "seconds": time.perf_counter() - start,
           "rchar": float(_rchar() - rchar)}  # fmt: skip
    if read:
        numbers = [int(w) for w in read[-1].split() if w.isdigit()]
        out |= {"requested": float(numbers[0]), "total": float(numbers[1])}
    if tiny:  # check the values (gathered, a collective)
        torch.manual_seed(0)
        state = ts.to_torch_state_dict(model)
        expected = transformers.LlamaForCausalLM(config).state_dict()
        out["equal"] = float(all(torch.equal(state[n], t) for n, t in expected.items()))
    return out


def _run(args: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode:
        raise SystemExit(f"{args} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


def _save(folder: Path, tiny: bool) -> int:
    """Both checkpoints of one seeded Llama; returns its tensor bytes."""
    import torchshard as ts

    ts.use_cpu_devices(8)
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(tiny))
    dcp.save(model.state_dict(), checkpoint_id=str(folder / "single"), no_dist=True)
    ts.save_dcp(folder / "sharded", ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp())))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(tiny))
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.hf_rules(model, fsdp_min_size=1024))
    ts.save_dcp(folder / "as_loaded", ts.shard(model, plan))
    return sum(t.numel() * t.element_size() for t in transformers.LlamaForCausalLM(_config(tiny)).state_dict().values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a 0.4 MB model: a smoke test of the script")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path (interleaved); medians reported")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save:  # with --child (--tiny), the loads follow in this process
        print(f"saved {_save(Path(args.dir), args.tiny)}", flush=True)
    if args.child:
        result = {how: _child(args.dir, how, args.tiny) for how in args.child.split(",")}
        if args.child.startswith("bytes"):
            import jax

            for how, numbers in result.items():
                Path(args.dir, f"{how}.rank{jax.process_index()}.json").write_text(json.dumps(numbers))
        else:
            print(json.dumps(result))
    if not (args.save or args.child):
        _report(*_measure(args), args.json)


def _measure(args: argparse.Namespace) -> tuple[int, dict, dict]:
    """The checkpoint's tensor bytes, the single-process loads' medians and each layout's 2-process loads."""
    me = [sys.executable, __file__, *(["--tiny"] if args.tiny else [])]
    paths = ("dcp.load", "load_dcp")
    layouts = {"single": "bytes", "sharded": "bytes_sharded", "as_loaded": "bytes_as_loaded"}
    # --tiny, a smoke test, spares process start-ups (each imports torch, JAX and transformers): the save and both
    # paths run in one process, the three layouts in one launch
    children = [paths] if args.tiny else [(how,) for how in paths]
    launches = [tuple(layouts.values())] if args.tiny else [(child,) for child in layouts.values()]
    with tempfile.TemporaryDirectory() as tmp:
        folder = ["--dir", tmp]
        saved = [] if args.tiny else _run([*me, "--save", *folder]).stdout.splitlines()
        rounds: list[dict] = []
        for _ in range(args.repeats):  # interleaved
            rounds.append({})
            for hows in children:
                save = [] if saved else ["--save"]  # --tiny: the first child saves
                lines = _run([*me, *save, "--child", ",".join(hows), *folder]).stdout.splitlines()
                saved = saved or lines
                rounds[-1].update(json.loads(lines[-1]))
        runs = {how: {k: statistics.median(r[how][k] for r in rounds) for k in ("rss", "seconds")} for how in paths}
        launch = [sys.executable, "-m", "torchshard.launch", "--nproc", "2", "--cpu-devices-per-proc", "4"]
        for hows in launches:
            _run([*launch, *me[1:], "--child", ",".join(hows), *folder])
        ranks = {layout: [json.loads(Path(tmp, f"{child}.rank{i}.json").read_text()) for i in range(2)]
                 for layout, child in layouts.items()}  # fmt: skip
    size = next(int(line.split()[1]) for line in saved if line.startswith("saved "))
    return size, runs, ranks


def _report(size: int, runs: dict, ranks: dict, json_path: str | None) -> None:
    print(f"checkpoint: {size / 1e6:.1f} MB of tensors, 8 simulated devices, hf_rules data=4 x model=2\n")
    print("| path | added peak RSS (MB) | × model bytes | wall (s) |")
    print("|---|---|---|---|")
    for name, run in (("dcp.load + shard", runs["dcp.load"]), ("load_dcp (meta + plan)", runs["load_dcp"])):
        print(f"| {name} | {run['rss'] / 1e6:.1f} | {run['rss'] / size:.2f} | {run['seconds']:.2f} |")
    print("\n2 processes × 4 devices: per process, of the checkpoint's tensor bytes")
    print("| checkpoint | DCP chunk bytes read | file bytes read (rchar) | added peak RSS (× model) | values equal |")
    print("|---|---|---|---|---|")
    for layout, rows in ranks.items():
        cells = [", ".join(f"{r[k] / size:.3f}" for r in rows) for k in ("requested", "rchar", "rss")]
        equal = "—" if "equal" not in rows[0] else str(all(r["equal"] == 1.0 for r in rows))
        print(f"| {layout} | {cells[0]} | {cells[1]} | {cells[2]} | {equal} |")
    if json_path:
        Path(json_path).write_text(json.dumps({"model_bytes": size, "runs": runs, "ranks": ranks}, indent=1))


if __name__ == "__main__":
    main()
