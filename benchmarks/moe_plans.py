"""Mixture of experts: per-step communication and time of expert parallelism against FSDP alone.

A Mixtral-style model from transformers (grouped_mm experts, the default) trains under three plans
on 8 devices: FSDP over data=8; expert parallelism over expert=8 with the batch over the same
devices; and hf_rules' tensor parallelism over model=2 with FSDP over data=4. For each: the
collectives of one compiled step (``ts.inspect.collectives``) and the median step time, the plans
interleaved in rounds.

    python benchmarks/moe_plans.py           # the README numbers
    python benchmarks/moe_plans.py --tiny    # seconds
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torchshard as ts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model and 2 timed rounds")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    return parser.parse_args()


def build(tiny: bool):
    import torch
    import transformers

    sizes = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128)
        if tiny
        else dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, vocab_size=8000)
    )
    config = transformers.MixtralConfig(
        **sizes, num_attention_heads=8, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, router_jitter_noise=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


PLANS = {
    # name: mesh axes, hf_rules arguments, batch spec
    "fsdp": ({"data": 8}, dict(axis=None), ("data",)),
    "expert_parallel": ({"expert": 8}, dict(axis=None, expert_axis="expert", fsdp_axis="expert"), ("expert",)),
    "tp+fsdp (hf_rules)": ({"data": 4, "model": 2}, {}, ("data",)),
}


def main() -> None:
    args = parse_args()
    ts.use_cpu_devices(8)
    import jax
    import optax
    import torch
    from jax.sharding import PartitionSpec as P

    batch, seq = (8, 16) if args.tiny else (args.batch, args.seq)
    vocab = 128 if args.tiny else 8000
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    trainers, placed = {}, {}
    warnings.simplefilter("ignore", ts.UnusedRuleWarning)
    for name, (axes, kwargs, batch_spec) in PLANS.items():
        model = build(args.tiny)
        plan = ts.plan(model, ts.make_mesh(axes), ts.presets.hf_rules(model, **kwargs))
        # the plans as GSPMD runs them; benchmarks/moe.py compares that with all-to-all token dispatch
        trainers[name] = ts.Trainer(model, lm_loss, optax.adamw(1e-4), plan, batch_spec=P(*batch_spec),
                                    expert_dispatch=ts.ExpertDispatch("gspmd"))  # fmt: skip
        placed[name] = ts.shard_batch(ids, plan.mesh, P(*batch_spec))
        stats = ts.inspect.collectives(trainers[name], ids)
        print(f"## {name} on {axes}\n{stats}\n", flush=True)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    rounds = 2 if args.tiny else args.rounds
    for name, trainer in trainers.items():  # compile and warm up
        jax.block_until_ready(trainer.step(placed[name])["loss"])
    for r in range(rounds):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            jax.block_until_ready(trainer.step(placed[name])["loss"])
            times[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{rounds}", flush=True)
    base = statistics.median(times["fsdp"])
    print("| plan | s/step | ÷ FSDP |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.3f} | {statistics.median(t) / base:.2f} |")


if __name__ == "__main__":
    main()
