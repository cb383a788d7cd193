"""Loading a pretrained checkpoint: ``load_safetensors`` into a meta model against ``from_pretrained`` + ``shard``.

A Llama (0.94 GB of fp32 tensors; ``--tiny``: 0.4 MB) saved with ``save_pretrained``, loaded
onto 8 simulated devices with ``hf_rules`` (data=4 × model=2) two ways, each in a fresh process
so neither sees the other's memory (``--tiny``: both in one, a smoke test):

* ``from_pretrained + shard``: transformers builds the whole model on the host, then ``shard``.
* ``load_safetensors``: the model is built on ``meta`` and the checkpoint read into its plan.

Each path runs ``--repeats`` times, interleaved, and the medians are reported: the added peak
host RSS (the peak during the load, VmHWM reset just before it, minus the RSS then) and
the wall time. On CPU the simulated devices' buffers are host memory too, so both paths hold
the sharded model once; the difference is the host copy. A last run starts 2 processes × 4
devices under ``torchshard.launch`` and reports the bytes of the slices each process asked
for, over the checkpoint's tensor bytes.

    python benchmarks/pretrained.py [--tiny]
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
    """A ``/proc/self/status`` memory field, in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _start_peak() -> int:
    """Resets the peak RSS (VmHWM) to the current RSS; returns the current RSS."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status("VmRSS")


def _child(path: str, how: str) -> dict[str, float]:
    """One load in this process: added peak RSS and seconds."""
    import logging

    import torchshard as ts

    if how != "bytes":
        ts.use_cpu_devices(8)
    else:
        ts.distributed.initialize()
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    mesh = ts.make_mesh({"data": 4, "model": 2})
    with torch.device("meta"):
        rules = ts.presets.hf_rules(transformers.AutoModelForCausalLM.from_config(config), fsdp_min_size=1024)
    read: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: read.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchshard").addHandler(handler)
    logging.getLogger("torchshard").setLevel(logging.INFO)
    before, start = _start_peak(), time.perf_counter()
    if how == "from_pretrained":
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        ts.shard(model, ts.plan(model, mesh, rules))
    else:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        ts.load_safetensors(path, model, ts.plan(model, mesh, rules))
    seconds = time.perf_counter() - start
    out = {"rss": float(_status("VmHWM") - before), "seconds": seconds}
    if read:
        numbers = [int(w) for w in read[-1].split() if w.isdigit()]
        out |= {"requested": float(numbers[0]), "total": float(numbers[1])}
    if how == "bytes" and out["total"] < 50e6:  # a small model: check the values too (gathered, a collective)
        from safetensors.torch import load_file

        stored, state = load_file(Path(path, "model.safetensors")), ts.to_torch_state_dict(model)
        out["equal"] = float(all(torch.equal(state[n], t) for n, t in stored.items()))
    return out


def _run_child(path: Path, hows: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each path of ``hows`` in turn in one fresh process: {how: its numbers}."""
    done = subprocess.run([sys.executable, __file__, "--child", ",".join(hows), "--dir", str(path)],
                          capture_output=True, text=True, timeout=1800, check=False)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{hows} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _run_two_processes(path: Path, out: Path) -> list[dict[str, float]]:
    command = [sys.executable, "-m", "torchshard.launch", "--nproc", "2", "--cpu-devices-per-proc", "4", __file__,
               "--child", "bytes", "--dir", str(path), "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode:
        raise SystemExit(f"2-process run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]


def _save(path: Path, tiny: bool) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(TINY if tiny else FULL), use_cache=False))
    model.save_pretrained(path)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a 0.4 MB model: a smoke test of the script")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path (interleaved); medians reported")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # from_pretrained, load_safetensors (comma-separated), bytes
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "bytes":
        result = _child(args.dir, "bytes")
        import jax

        Path(args.out, f"rank{jax.process_index()}.json").write_text(json.dumps(result))
        return
    if args.child:
        print(json.dumps({how: _child(args.dir, how) for how in args.child.split(",")}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp, "llama"), Path(tmp, "out")
        out.mkdir()
        size = _save(folder, args.tiny)
        paths = ("from_pretrained", "load_safetensors")
        # --tiny runs both paths in one child: a 0.4 MB model's memory says nothing, and a process start (importing
        # torch, transformers and JAX) is most of a smoke run's time
        children = [paths] if args.tiny else [(how,) for how in paths]
        rounds = [
            {k: v for hows in children for k, v in _run_child(folder, hows).items()} for _ in range(args.repeats)
        ]  # interleaved
        runs = {how: {k: statistics.median(r[how][k] for r in rounds) for k in ("rss", "seconds")} for how in paths}
        ranks = _run_two_processes(folder, out)
    base, new = runs["from_pretrained"], runs["load_safetensors"]
    print(f"checkpoint: {size / 1e6:.1f} MB of tensors, 8 simulated devices, hf_rules data=4 x model=2\n")
    print("| path | added peak RSS (MB) | × model bytes | wall (s) |")
    print("|---|---|---|---|")
    for name, run in (("from_pretrained + shard", base), ("load_safetensors (meta + plan)", new)):
        print(f"| {name} | {run['rss'] / 1e6:.1f} | {run['rss'] / size:.2f} | {run['seconds']:.2f} |")
    print(f"\nRSS ratio load_safetensors / from_pretrained+shard: {new['rss'] / max(base['rss'], 1):.2f}")
    print(f"wall ratio load_safetensors / from_pretrained+shard: {new['seconds'] / base['seconds']:.2f}")
    fractions = [r["requested"] / r["total"] for r in ranks]
    print("bytes requested per process (2 processes x 4 devices), of the checkpoint's tensor bytes: "
          + ", ".join(f"{f:.3f}" for f in fractions))  # fmt: skip
    if args.json:
        result = {"model_bytes": size, "from_pretrained": base, "load_safetensors": new, "fractions": fractions,
                  "values_equal": [r.get("equal") for r in ranks]}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
