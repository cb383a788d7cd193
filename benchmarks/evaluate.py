"""Trainer.evaluate against the eager evaluation loop on the same sharded model, batches and run.

The model is the 2-layer, width-64 transformers Llama of issue 34, trained on data=4 × model=2
(hf_rules). The eager loop is what a user writes without `evaluate`:
``with torchax.default_env(): loss_fn(trainer.model, ts.shard_batch(b, mesh))``, every op
dispatched alone; `evaluate` is one compiled call (compiled once, before timing).

    python benchmarks/evaluate.py            # the README numbers
    python benchmarks/evaluate.py --tiny     # seconds; what the smoke test runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torchshard as ts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=8, help="timed batches per method, interleaved")
    parser.add_argument("--batch", default="16x64", help="rows x sequence length")
    parser.add_argument("--tiny", action="store_true", help="2 batches of 8x16 (smoke test)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args()


def build():
    import optax
    import torch
    import transformers

    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = transformers.LlamaConfig(**sizes, intermediate_size=128, vocab_size=256, use_cache=False)
    torch.manual_seed(0)  # the same model every run
    model = transformers.LlamaForCausalLM(config)
    mesh = ts.make_mesh({"data": 4, "model": 2})
    plan = ts.plan(model, mesh, ts.presets.hf_rules(model))
    return ts.Trainer(model, loss_fn, optax.adamw(1e-3), plan), mesh


def loss_fn(model, ids):
    return model(input_ids=ids, labels=ids).loss


def main() -> None:
    args = parse_args()
    ts.use_cpu_devices(8)
    import jax
    import torch
    import torchax

    batches, (rows, seq) = (2, (8, 16)) if args.tiny else (args.batches, map(int, args.batch.split("x")))
    trainer, mesh = build()
    data = [torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(i)) for i in range(batches)]
    trainer.step(data[0])

    def eager(b):
        with torchax.default_env():
            return loss_fn(trainer.model, ts.shard_batch(b, mesh)).jax()

    def compiled(b):
        return trainer.evaluate(b)["loss"]

    jax.block_until_ready(compiled(data[0]))  # compile once
    jax.block_until_ready(eager(data[0]))  # warm torchax's op caches
    times: dict[str, list[float]] = {"eager loop": [], "evaluate": []}
    losses = []  # per batch: the eager loop's and evaluate's, the same f32 computation fused differently
    for b in data:  # interleaved, so load drifts hit both alike
        values = {}
        for name, fn in (("eager loop", eager), ("evaluate", compiled)):
            start = time.perf_counter()
            values[name] = float(fn(b))
            times[name].append(time.perf_counter() - start)
        losses.append([values["eager loop"], values["evaluate"]])
        print(f"batch: eager loss {values['eager loop']:.6f}  evaluate loss {values['evaluate']:.6f}", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    speedup = median["eager loop"] / median["evaluate"]
    result = {"batch": [rows, seq], "median_s": median, "speedup": speedup, "losses": losses}
    print(f"median per batch: eager loop {median['eager loop']:.4f} s, evaluate {median['evaluate']:.5f} s, "
          f"evaluate is {speedup:.1f}x faster")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
