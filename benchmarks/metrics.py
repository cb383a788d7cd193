"""Run metrics checked: ``trainer.flops_per_step`` against the analytic count, and what logging costs a step.

1. **FLOPs.** A Hugging Face Llama (4 layers, width 256, 8 heads over 4 KV heads, MLP 688, vocab
   2048, sequence 256, batch 16; untied head) on 8 simulated devices (``data=8``). The analytic
   count is torchtitan's: ``6·N + 12·L·d·S`` FLOPs per token, where ``N`` is every parameter but
   the input embedding (a lookup, not a matmul), ``L`` the layers, ``d`` the attention width
   (heads × head dim) and ``S`` the sequence (causal attention counted whole: transformers passes
   an explicit mask, so every tile runs). The HLO counts are one device's matmuls (loops counted
   by their trip counts) times the device count: ``model_flops_per_step``, what MFU uses, and
   ``flops_per_step``, which adds the scores the tiled attention's backward recomputes (one more
   ``2·S·d`` per token and layer, as FlashAttention's backward). Checked: both within 5 %.
2. **Logging cost.** The same model stepped by two Trainers, one with ``log_every=10`` and a
   ``ts.track.JSONL`` tracker, one logging nothing, in interleaved rounds of ``--steps`` steps
   (each round waits for its last step); the ratio of the two round times is taken per pair of
   rounds and its median reported. Checked: at most 1.02.

    python benchmarks/metrics.py                # both; exits 1 when a check fails
    python benchmarks/metrics.py --rounds 8 --steps 20 --batch 8 --seq 128   # the README's run (a shorter one)
    python benchmarks/metrics.py --rounds 2 --steps 10 --layers 1 --seq 64   # a smoke run (checks FLOPs only)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torchshard as ts

DEVICES = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds per Trainer (default: 8)")
    parser.add_argument("--steps", type=int, default=30, help="steps per round (default: 30)")
    return parser.parse_args()


def llama(layers: int):
    import torch
    import transformers

    shape = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 688}
    config = transformers.LlamaConfig(num_hidden_layers=layers, vocab_size=2048, max_position_embeddings=1024,
                                      use_cache=False, tie_word_embeddings=False, **shape)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def analytic_flops(model, *, tokens: int, seq: int) -> float:
    """torchtitan's count: 6 FLOPs per matmul parameter per token, plus 12·L·d·S per token for attention."""
    config = model.config
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    return tokens * (6 * params + 12 * config.num_hidden_layers * width * seq)


def trainer_for(layers: int, **kwargs):
    import optax

    model = llama(layers)
    plan = ts.plan(model, ts.make_mesh({"data": DEVICES}))
    loss = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    return ts.Trainer(model, loss, optax.adamw(1e-4), plan, **kwargs)


def round_time(trainer, batch, steps: int) -> float:
    began = time.perf_counter()
    for _ in range(steps):
        metrics = trainer.step(batch)
    float(metrics["loss"])  # the round ends when its last step has
    return time.perf_counter() - began


def main() -> int:
    args = parse_args()
    ts.use_cpu_devices(DEVICES)
    import torch

    batch = torch.randint(0, 2048, (args.batch, args.seq))
    quiet, logged = trainer_for(args.layers), None
    with tempfile.TemporaryDirectory() as tmp:
        logged = trainer_for(args.layers, log_every=10, trackers=[ts.track.JSONL(Path(tmp) / "m.jsonl")])
        for trainer in (quiet, logged):
            round_time(trainer, batch, 3)  # compile, warm up
        counted = {"model_flops_per_step": quiet.model_flops_per_step, "flops_per_step": quiet.flops_per_step}
        expected = analytic_flops(quiet.model, tokens=args.batch * args.seq, seq=args.seq)
        print(f"| FLOPs per step | value | / analytic |\n|---|---|---|\n| analytic 6·N·tokens + 12·L·d·S·tokens | "
              f"{expected:.4e} | 1 |")  # fmt: skip
        for name, flops in counted.items():
            print(f"| HLO: {name} × {DEVICES} | {flops * DEVICES:.4e} | {flops * DEVICES / expected:.4f} |")
        ratios = []
        for _ in range(args.rounds):
            plain = round_time(quiet, batch, args.steps)
            with_logging = round_time(logged, batch, args.steps)
            ratios.append(with_logging / plain)
        logged.close()
        rows = len((Path(tmp) / "m.jsonl").read_text().splitlines())
    median = statistics.median(ratios)
    print(f"\n| logging | value |\n|---|---|\n| step time, log_every=10 + JSONL / no logging (median of "
          f"{args.rounds} round pairs of {args.steps} steps) | {median:.4f} |\n| rows written | {rows} |")  # fmt: skip
    failed = []
    for name, flops in counted.items():
        if abs(flops * DEVICES / expected - 1) > 0.05:
            failed.append(f"{name} is {flops * DEVICES / expected:.3f}× the analytic count (allowed: within 5 %)")
    if args.rounds >= 8 and median > 1.02:  # a smoke run's few rounds are too noisy to judge
        failed.append(f"logging costs {100 * (median - 1):.1f} % of step time (allowed: 2 %)")
    for failure in failed:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
