"""A small Hugging Face Llama sharded by its own tp_plan + FSDP and trained on 8 simulated CPU devices.

The model is built from a config with random weights (nothing is downloaded).
``presets.hf_rules(model)`` turns the model's ``tp_plan`` into rules (q/k/v/gate/up
column-parallel, o/down row-parallel, embedding and head split over the vocabulary) over
``"model"``, adds FSDP over ``"data"``, and makes ``plan`` check the config's head counts
against the ``"model"`` axis. The task is learnable: count upwards modulo the vocabulary.

Run::

    python examples/hf_llama.py                       # mesh data=4,model=2, 20 steps
    python examples/hf_llama.py --mesh data=2,model=4 --heads 8 --kv-heads 4 --steps 5
"""

from __future__ import annotations

import argparse
import math
import sys

import optax
import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import torchshard as ts
from torchshard import presets


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=4,model=2"`` → ``{"data": 4, "model": 2}``."""
    pairs = (part.split("=") for part in text.split(","))
    return {name.strip(): int(size) for name, size in pairs}


def build(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=args.tie,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def counting_batch(step: int, *, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Rows ``start, start+1, ...`` modulo ``vocab``: the next token is always predictable."""
    start = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(step))
    return (start + torch.arange(seq)) % vocab


def lm_loss(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def train(args: argparse.Namespace) -> list[float]:
    model = build(args)
    mesh = ts.make_mesh(parse_mesh(args.mesh))
    plan = ts.plan(model, mesh, presets.hf_rules(model, fsdp_min_size=args.fsdp_min_size))
    print(plan)
    trainer = ts.Trainer(model, lm_loss, optax.adamw(args.lr, weight_decay=0.0), plan)
    batch = lambda step: counting_batch(step, batch=args.batch, seq=args.seq, vocab=args.vocab)  # noqa: E731
    if args.collectives:
        print(ts.inspect.collectives(trainer, batch(0)))
    losses = []
    with tqdm(range(args.steps), desc="train", unit="step") as bar:
        for step in bar:
            losses.append(float(trainer.step(batch(step))["loss"]))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=4,model=2", help="axis sizes, e.g. data=4,model=2")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices (0: use the backend's)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fsdp-min-size", type=int, default=2**12)
    parser.add_argument("--tie", action=argparse.BooleanOptionalAction, default=False, help="tie embeddings")
    parser.add_argument("--collectives", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:
        ts.use_cpu_devices(args.cpu_devices)
    losses = train(args)
    print(f"loss {losses[0]:.4f} → {losses[-1]:.4f} over {len(losses)} steps")
    return 0 if all(math.isfinite(v) for v in losses) else 1


if __name__ == "__main__":
    sys.exit(main())
