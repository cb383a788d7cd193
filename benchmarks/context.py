"""Context parallelism: compiled temp memory per device and step time against sequence length.

A plain-torch causal transformer LM (SDPA attention, grouped K/V heads) trains with AdamW on
``--batch`` sequences per step (every device holds a part of each). Its sequence is split over
``context`` = 1, 2, 4, 8 devices with ``ContextParallel`` (ring attention, load-balanced);
context=1 is the ordinary Trainer (the whole sequence on one device, torchshard's usual attention),
and "1 + ContextParallel" the same device running the ring kernel (one block, its backward
recomputing the scores). Memory is the compiled step's ``memory_analysis()`` temp bytes per device
(nothing is allocated to measure it); time is the median of timed steps, for runs whose compiled
memory fits ``--fits`` and sequences up to ``--time-up-to``.

    python benchmarks/context.py                                  # the README tables
    python benchmarks/context.py --seqs 1024 --contexts 1,4 --steps 0   # memory only, seconds
    python benchmarks/context.py --seqs 1024 --contexts 1,4 --batch 16  # 16 rows per device
"""

from __future__ import annotations

import argparse
import statistics
import time

import torchshard as ts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384", help="sequence lengths")
    parser.add_argument("--contexts", default="1,2,4,8", help="context axis sizes (1: no context parallelism)")
    parser.add_argument("--attention", default="ring", choices=["ring", "all_gather"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (median; 0: memory only)")
    parser.add_argument("--time-up-to", type=int, default=4096, help="time runs up to this sequence length")
    parser.add_argument("--fits", type=float, default=4.0, help="GiB of compiled memory a timed run may need")
    parser.add_argument("--batch", type=int, default=1, help="rows per step (the mesh has only the context axis)")
    parser.add_argument(
        "--documents",
        type=int,
        default=0,
        help="pack each row with documents of this many tokens (ts.document_mask; 0: one per row)",
    )
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    return parser.parse_args()


def build(dim: int, layers: int, seq: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = 8, 4, dim // 8
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.q, self.kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * self.kv_heads * self.head_dim)
            self.out = nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, h, mask):
            b, s, _ = h.shape
            x = self.norm1(h)
            q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
            k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                           enable_gqa=True)  # fmt: skip
            h = h + self.out(y.transpose(1, 2).reshape(b, s, dim))
            return h + self.mlp(self.norm2(h))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pos = nn.Embedding(256, dim), nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256)

        def forward(self, ids, positions=None):
            if positions is None:
                h, mask = self.embed(ids) + self.pos(torch.arange(ids.shape[1])), None
            else:
                h, mask = self.embed(ids) + self.pos(positions), ts.document_mask(positions)
            for block in self.blocks:
                h = block(h, mask)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return LM()


def lm_loss(model, batch):
    import torch

    ids, labels, *positions = batch
    logits = model(ids, *positions)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def run(args: argparse.Namespace, seq: int, context: int, kernel: bool) -> tuple[int, float | None]:
    """(temp bytes per device, median step seconds or None) of one configuration."""
    import jax
    import optax
    import torch

    model = build(args.dim, args.layers, seq)
    mesh = ts.make_mesh({"context": context}, devices=jax.devices()[:context])
    cp = ts.ContextParallel(attention=args.attention) if kernel else None
    trainer = ts.Trainer(model, lm_loss, optax.adamw(1e-4), ts.plan(model, mesh), batch_spec=(None, "context"),
                         context=cp)  # fmt: skip
    ids = torch.randint(0, 256, (args.batch, seq + 1), generator=torch.Generator().manual_seed(seq))
    batch = (ids[:, :-1], ids[:, 1:], *([positions(args, seq)] if args.documents else []))
    batch = trainer.place_batch(batch)
    memory = trainer.lower(batch).compile().memory_analysis()
    needed = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    if args.steps == 0 or seq > args.time_up_to or needed > args.fits * 2**30:
        return memory.temp_size_in_bytes, None
    jax.block_until_ready(trainer.step(batch)["loss"])  # compile and warm up
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(trainer.step(batch)["loss"])
        times.append(time.perf_counter() - start)
    return memory.temp_size_in_bytes, statistics.median(times)


def positions(args: argparse.Namespace, seq: int):
    """Position ids of rows packed with ``--documents``-token documents (the last one shorter)."""
    import torch

    return (torch.arange(seq) % args.documents).expand(args.batch, seq).contiguous()


def skipped_fraction(args: argparse.Namespace, seq: int, devices: int) -> float:
    """The fraction of (query run, key tile) pairs the ring kernel skips as having no visible pair.

    Mirrors the kernel's schedule: each device's rows are ``parts`` runs (2, zig-zag, when balanced),
    every key run is folded in tiles of at most 512 keys, and a tile is skipped when it lies after
    the query run (causal) or, packed, no row shares a document between the two.
    """
    import numpy as np

    parts = 2
    run = seq // (devices * parts)
    tiles = -(-run // 512)
    size = run // tiles
    docs = np.arange(seq) // args.documents if args.documents else np.zeros(seq, int)
    starts = [s for i in range(devices) for s in (i * run, (2 * devices - 1 - i) * run)]
    pairs = [(q, k + t * size) for q in starts for k in starts for t in range(tiles)]
    skipped = sum(k > q + run - 1 or docs[k + size - 1] < docs[q] or docs[k] > docs[q + run - 1] for q, k in pairs)
    return skipped / len(pairs)


def table(title: str, seqs: list[int], columns: list[tuple[int, bool]], cell) -> str:
    names = [f"context={c}" + (" + ContextParallel" if kernel and c == 1 else "") for c, kernel in columns]
    head = "| seq | " + " | ".join(names) + " |"
    rule = "|---" * (len(columns) + 1) + "|"
    rows = [f"| {s} | " + " | ".join(cell(s, col) for col in columns) + " |" for s in seqs]
    return "\n".join([f"### {title}", "", head, rule, *rows, ""])


def main() -> None:
    args = parse_args()
    ts.use_cpu_devices(8)
    seqs = [int(s) for s in args.seqs.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    # context=1 twice: the ordinary Trainer (the baseline), then the same device through the ring kernel
    columns = [(c, kernel) for c in contexts for kernel in ((False, True) if c == 1 else (True,))]
    results = {(s, col): run(args, s, *col) for s in seqs for col in columns}
    base = {s: results[(s, columns[0])][0] for s in seqs}

    def memory(s: int, col: tuple[int, bool]) -> str:
        temp = results[(s, col)][0]
        return f"{temp / 2**20:.1f} MiB ({temp / base[s]:.2f}×)"

    def step(s: int, col: tuple[int, bool]) -> str:
        seconds = results[(s, col)][1]
        return "—" if seconds is None else f"{seconds * 1e3:.0f} ms"

    heads = "8 heads / 4 KV heads" + (f", documents of {args.documents} tokens" if args.documents else "")
    where = f"{args.layers} layers, dim {args.dim}, {heads}, batch {args.batch}, {args.attention} attention"
    print(table(f"Compiled temp memory per device ({where}; × the first column)", seqs, columns, memory))
    for c in contexts[1:] if contexts[0] == 1 else contexts:
        print(
            f"context={c}: ring tiles skipped " + ", ".join(f"seq {s} {skipped_fraction(args, s, c):.0%}" for s in seqs)
        )
    if args.steps:
        print(table(f"Step time (median of {args.steps}; — not timed)", seqs, columns, step))


if __name__ == "__main__":
    main()
