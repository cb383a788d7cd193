"""Tokens per second of ``ts.generate`` against transformers' eager ``generate``, on the mesh and on the CPU.

A transformers Llama (built from a config, nothing downloaded) sharded with ``presets.hf_rules`` on
data=4 × model=2 simulated CPU devices decodes greedily:

* ``ts.generate``, both loops: every step inside one jitted call (``loop="fused"``) and one
  compiled step called per token (``loop="stepped"``); compilation is not timed (a warm-up call);
* transformers' ``model.generate(do_sample=False)`` on the same sharded model, eager under torchax
  (each op dispatched alone), over ``--eager-new`` tokens (it is slow; tokens/s is a rate);
* transformers' ``generate`` in eager torch on the CPU, in a process of its own (eager torch timed
  in a process that runs JAX is meaningless: the thread pools fight).

Every way decodes the same prompts with the same weights and must give the same tokens.

Run::

    python benchmarks/generate.py            # the README's numbers
    python benchmarks/generate.py --tiny     # smoke test: a tiny model, a few tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--new", type=int, default=32, help="new tokens per row")
    parser.add_argument("--eager-new", type=int, default=4, help="new tokens for eager generate on the mesh")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each way (median)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a few tokens (smoke test)")
    parser.add_argument("--torch-baseline", action="store_true", help=argparse.SUPPRESS)  # the CPU child
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.prompt, args.new, args.eager_new = 8, 8, 4, 2
        args.hidden, args.layers, args.repeats = 64, 2, 1
    return args


def build(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=8000 if not args.tiny else 256,
        max_position_embeddings=args.prompt + args.new,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    return model, ids


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls of ``fn`` (the last result too)."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def torch_baseline(args: argparse.Namespace) -> None:
    """Eager torch on the CPU: prints {"seconds", "tokens"} as JSON."""
    import torch

    model, ids = build(args)
    with torch.no_grad():
        run = lambda: model.generate(ids, max_new_tokens=args.new, do_sample=False, eos_token_id=None)  # noqa: E731
        run()  # warm-up
        seconds, out = timed(run, args.repeats)
    print(json.dumps({"seconds": seconds, "tokens": out.tolist()}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.torch_baseline:
        torch_baseline(args)
        return 0
    child = [sys.executable, __file__, "--torch-baseline", *(argv if argv is not None else sys.argv[1:])]
    cpu = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout)

    import numpy as np
    import torch

    import torchshard as ts

    ts.use_cpu_devices(8)
    import torchax  # after torchshard, whose shims let this torchax import on this torch

    model, ids = build(args)
    mesh = ts.make_mesh({"data": 4, "model": 2})
    model = ts.shard(model, ts.plan(model, mesh, ts.presets.hf_rules(model)))
    rates, outs = {}, {}
    for loop in ("fused", "stepped"):
        run = lambda loop=loop: ts.generate(model, ids, max_new_tokens=args.new, eos_token_id=[], loop=loop)  # noqa: E731
        run()  # compiles
        seconds, outs[loop] = timed(run, args.repeats)
        rates[loop] = args.batch * args.new / seconds

    def eager(new: int) -> torch.Tensor:
        with torchax.default_env(), torch.no_grad():
            out = model.generate(ids.to("jax"), max_new_tokens=new, do_sample=False, eos_token_id=None)
            return torch.from_numpy(np.array(out.jax())).to(torch.int64)

    eager(1)  # warm-up: torchax compiles each op's kernel on first use
    seconds, eager_out = timed(lambda: eager(args.eager_new), 1)
    rates["eager"] = args.batch * args.eager_new / seconds
    rates["cpu"] = args.batch * args.new / cpu["seconds"]
    same = all(torch.equal(o, torch.tensor(cpu["tokens"])) for o in outs.values())
    same = same and torch.equal(eager_out, outs["fused"][:, : args.prompt + args.eager_new])
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {model.config.vocab_size}; batch {args.batch}, "
          f"prompt {args.prompt}, {args.new} new tokens ({args.eager_new} for eager generate on the mesh); "
          f"data=4×model=2, hf_rules; same tokens every way: {'yes' if same else 'NO'}")  # fmt: skip
    print("\n| way | tokens/s | × eager generate on the mesh | × eager torch on the CPU |")
    print("|---|---|---|---|")
    names = {
        "fused": "ts.generate, one jitted loop",
        "stepped": "ts.generate, a compiled step per token",
        "eager": "transformers generate, eager on the mesh",
        "cpu": "transformers generate, eager torch on the CPU",
    }
    for key, name in names.items():
        print(f"| {name} | {rates[key]:.1f} | {rates[key] / rates['eager']:.1f}× | {rates[key] / rates['cpu']:.2f}× |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
