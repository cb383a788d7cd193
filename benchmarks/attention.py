"""torchshard's SDPA lowering (tiled, flash-style) against the former one (scores materialised): memory and speed.

    python benchmarks/attention.py          # one Llama-3-8B attention at sequence 8192, CPU speed at two sizes
    python benchmarks/attention.py --tiny   # small sizes (the smoke test)

Memory: the compiled fwd+bwd of one causal attention (bf16, GQA), plain and under
``jax.checkpoint(policy=dots_saveable)``: ``memory_analysis()`` temp bytes (nothing is allocated)
and the FLOPs and bytes accessed `torchshard._hlo.costs.step_costs` reads from its HLO (loops
weighted by their trip counts; what the tiles pass among their own instructions apart), beside
the FLOPs the tiling implies (7 dots per visible tile pair: 2 forward, 5 backward). Speed: median
fwd+bwd time of interleaved rounds, causal, f32, on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from torchshard._bridge.ops import flash
from torchshard._bridge.ops.attention import _grouped, attention_jax
from torchshard._hlo.costs import step_costs


def materialised(query, key, value, attn_mask, is_causal, scale):
    """The former lowering (causal only): 1-8 query blocks, each block's f32 scores materialised and saved."""
    b, n, s, h = query.shape
    q = _grouped(query, key.shape[1], scale)
    blocks = next((k for k in (8, 4, 2) if s % k == 0 and s // k >= 64), 1)
    c, outs = s // blocks, []
    for i in range(blocks):
        end = (i + 1) * c
        logits = jnp.einsum("bkgqh,bksh->bkgqs", q[:, :, :, i * c : end], key[:, :, :end],
                            preferred_element_type=jnp.float32)  # fmt: skip
        rows = jax.lax.broadcasted_iota(jnp.int32, (c, end), 0) + i * c
        keep = rows >= jax.lax.broadcasted_iota(jnp.int32, (c, end), 1)
        probs = jax.nn.softmax(jnp.where(keep, logits, jnp.finfo(jnp.float32).min), axis=-1)
        outs.append(jnp.einsum("bkgqs,bksh->bkgqh", probs.astype(value.dtype), value[:, :, :end]))
    return jnp.concatenate(outs, axis=3).reshape(b, n, s, h)


LOWERINGS = {"tiled (flash)": attention_jax, "materialised (before)": materialised}


def fwd_bwd(lowering, policy=None):
    loss = lambda q, k, v: lowering(q, k, v, None, True, None).astype(jnp.float32).sum()  # noqa: E731
    return jax.jit(jax.grad(jax.checkpoint(loss, policy=policy) if policy else loss, argnums=(0, 1, 2)))


def tiled_flops(b: int, heads: int, seq: int, dim: int) -> float:
    """7 dots of 2·rows·keys·dim per (batch, head) per visible pair of the tiling `attention_jax` picks."""
    tile = flash.tile_size(seq)
    whole, cut = flash.Tiling(tile, tile, causal=True).pairs(seq, seq)
    return 7 * (len(whole) + len(cut)) * 2 * b * heads * tile * tile * dim


def memory_rows(b: int, heads: int, kv: int, seq: int, dim: int) -> list[list[str]]:
    q = jax.ShapeDtypeStruct((b, heads, seq, dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, kv, seq, dim), jnp.bfloat16)
    rows = []
    for remat, policy in (("none", None), ("dots_saveable", jax.checkpoint_policies.dots_saveable)):
        for name, lowering in LOWERINGS.items():
            compiled = fwd_bwd(lowering, policy).lower(q, k, k).compile()
            costs = step_costs(compiled.as_text())
            temp = compiled.memory_analysis().temp_size_in_bytes
            rows.append([name, remat, f"{temp / 2**20:,.1f}", f"{costs.flops / 1e9:,.3f}",
                         f"{costs.bytes_accessed / 2**30:,.2f}", f"{costs.tile_bytes / 2**30:,.2f}"])  # fmt: skip
    return rows


def speed_rows(shapes: list[tuple[int, int, int, int]], rounds: int) -> list[list[str]]:
    rows = []
    for b, heads, seq, dim in shapes:
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(key, (b, heads, seq, dim)) for key in keys)
        fns = {name: fwd_bwd(lowering) for name, lowering in LOWERINGS.items()}
        for f in fns.values():
            jax.block_until_ready(f(q, k, v))
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):  # interleaved: the machine's load hits both alike
            for name, f in fns.items():
                start = time.perf_counter()
                jax.block_until_ready(f(q, k, v))
                times[name].append(time.perf_counter() - start)
        new, old = (statistics.median(times[name]) for name in LOWERINGS)
        rows.append([f"[{b}, {heads}, {seq}, {dim}]", f"{new * 1e3:,.1f}", f"{old * 1e3:,.1f}", f"{new / old:.2f}"])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small sizes: the smoke test")
    parser.add_argument("--seq", type=int, default=8192, help="sequence of the memory table")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per size")
    args = parser.parse_args()
    b, heads, kv, seq, dim = (1, 4, 2, 1024, 16) if args.tiny else (1, 32, 8, args.seq, 128)
    print(f"one causal attention fwd+bwd, bf16, [{b}, {heads} heads ({kv} KV), {seq}, {dim}]; "
          f"the tiling's FLOPs: {tiled_flops(b, heads, seq, dim) / 1e9:,.3f} G")  # fmt: skip
    header = ["lowering", "remat", "temp (MiB)", "FLOPs (G)", "bytes accessed (GiB)", "within tiles (GiB)"]
    print(table(header, memory_rows(b, heads, kv, seq, dim)))
    shapes = [(2, 4, 128, 16), (1, 4, 512, 16)] if args.tiny else [(16, 8, 256, 64), (2, 8, 2048, 64)]
    print()
    header = ["fwd+bwd, f32, causal", "tiled (ms)", "materialised (ms)", "tiled / materialised"]
    print(table(header, speed_rows(shapes, 2 if args.tiny else args.rounds)))


if __name__ == "__main__":
    main()
