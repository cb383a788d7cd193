"""Step time of torchshard's Trainer against hand-written JAX, the torchax tutorial pattern and eager torch.

Two tables: the tutorial MLP (``--workloads mlp``) and a transformers Llama (``--workloads llama``:
hidden 512, 4 layers, 8 heads, vocab 8000, batch 16 × seq 256, AdamW), each config against the
same step written by hand in JAX with the Trainer's shardings (`jax_llama.py` for the Llama), and
its model FLOP/s against a plain jitted GEMM on the same devices, measured in the same run.

    python benchmarks/step_time.py                           # both tables (the README numbers)
    python benchmarks/step_time.py --workloads llama --tiny  # seconds; what the smoke test runs
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable

import torchshard as ts

SIZES = (784, 1024, 1024, 1024, 10)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=8, help="0: use JAX's default devices")
    parser.add_argument("--configs", default="dp,tp,fsdp")
    parser.add_argument("--no-torch", action="store_true", help="skip eager torch (slow on big batches)")
    parser.add_argument("--workloads", default="mlp,llama", help="mlp, llama or both")
    parser.add_argument("--llama-configs", default="one_device,fsdp,fsdp_tp")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (smoke test)")
    return parser.parse_args()


def median_times(fns: list[Callable[[], object]], steps: int, warmup: int) -> list[float]:
    """Median wall time of each ``fn()`` (waiting for its result), calls interleaved so load drifts hit all alike."""
    import jax

    for _ in range(warmup):
        for fn in fns:
            jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(steps):
        for fn, record in zip(fns, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            record.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def median_time(step: Callable[[], object], steps: int, warmup: int) -> float:
    return median_times([step], steps, warmup)[0]


def build_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(SIZES) - 2 else [])
    return nn.Sequential(*layers)


def batch(n: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(n, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (n,), generator=g)


def loss_fn(model, b):
    import torch.nn.functional as F

    return F.cross_entropy(model(b[0]), b[1])


def config(name: str):
    linear = [str(2 * i) for i in range(len(SIZES) - 1)]
    if name == "tp":
        return {"data": -1, "model": 2}, ts.presets.tensor_parallel(colwise=linear[0::2], rowwise=linear[1::2])
    if name == "fsdp":
        return {"data": -1}, ts.presets.fsdp("data")
    return {"data": -1}, ts.presets.data_parallel()


def optimizer():
    import optax

    return optax.adamw(1e-4, weight_decay=0.01)


def trainer_step(name: str, b):
    axes, rules = config(name)
    model = build_model()
    trainer = ts.Trainer(model, loss_fn, optimizer(), ts.plan(model, ts.make_mesh(axes), rules))
    placed = trainer.place_batch(b)
    return trainer, lambda: trainer.step(placed)["loss"]


def jax_step(trainer, b):
    """The same step written by hand in JAX, with the Trainer's shardings and donation."""
    import jax
    import jax.numpy as jnp
    import optax

    opt = optimizer()
    names = [f"{2 * i}" for i in range(len(SIZES) - 1)]

    def loss(params, x, y):
        h = x
        for i, n in enumerate(names):
            h = h @ params[f"{n}.weight"].T + params[f"{n}.bias"]
            h = jax.nn.relu(h) if i < len(names) - 1 else h
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    shardings = trainer.state_shardings()
    out = (
        shardings.params,
        shardings.opt_state,
        jax.sharding.NamedSharding(trainer.mesh, jax.sharding.PartitionSpec()),
    )
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=out)
    params = {k: jnp.copy(v) for k, v in trainer.state.params.items()}
    state = jax.jit(opt.init, out_shardings=shardings.opt_state)(params)
    x, y = trainer.place_batch(b)
    holder = {"params": params, "state": state}

    def run():
        holder["params"], holder["state"], value = jitted(holder["params"], holder["state"], x, y)
        return value

    return run


def tutorial_step(name: str, b):
    """The torchax tutorial pattern: jit'd value_and_grad, then optax through call_jax outside jit."""
    import jax
    import optax
    import torch
    import torchax
    import torchax.interop as interop

    axes, rules = config(name)
    model = build_model()
    plan = ts.plan(model, ts.make_mesh(axes), rules)
    ts.shard(model, plan)
    weights = dict(model.named_parameters())
    opt = optimizer()

    def loss_fun(w, xy):
        return loss_fn(lambda x: torch.func.functional_call(model, w, (x,)), xy)

    grad_fn = interop.jax_jit(interop.jax_value_and_grad(loss_fun))
    xy = ts.shard_batch(tuple(b), plan.mesh)
    holder = {"w": weights, "state": interop.call_jax(opt.init, weights)}

    def run():
        with torchax.default_env():
            value, grads = grad_fn(holder["w"], xy)
            updates, holder["state"] = interop.call_jax(opt.update, grads, holder["state"], holder["w"])
            # the eager update is ~100 small dispatches; on simulated CPU devices too many queued
            # collectives abort XLA ("rendezvous ... Termination timeout"), so settle them here
            jax.block_until_ready(interop.jax_view(updates))
            holder["w"] = interop.call_jax(optax.apply_updates, holder["w"], updates)
        # wait for the eager optimizer work too, or it would run into the next timed step
        return value.jax(), [w.jax() for w in holder["w"].values()]

    return run


def torch_step(b):
    import torch

    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def run():
        opt.zero_grad()
        loss = loss_fn(model, b)
        loss.backward()
        opt.step()
        return loss.detach()

    return run


def gemm_flops_per_s(mesh, shape: tuple[int, int, int], steps: int, warmup: int) -> float:
    """FLOP/s of one plain jitted ``[m, k] × [k, n]`` GEMM, its rows over every device of ``mesh``: the roofline."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    m, k, n = shape
    x = jax.device_put(jnp.ones((m, k), jnp.float32), NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names))))
    w = jax.device_put(jnp.ones((k, n), jnp.float32), NamedSharding(mesh, PartitionSpec()))
    f = jax.jit(lambda a, b: a @ b)
    return 2 * m * k * n / median_time(lambda: f(x, w), steps, warmup)


def step_flops(n: int) -> int:
    return 6 * n * sum(a * b for a, b in itertools.pairwise(SIZES))


def per_device_bytes(trainer) -> int:
    """Largest bytes held on one device by params and optimizer state."""
    import jax

    totals: dict[object, int] = {}
    for leaf in jax.tree.leaves((trainer.state.params, trainer.state.opt_state)):
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return max(totals.values())


def row(name: str, args, b, gemm: float, torch_s: float | None) -> dict[str, object]:
    trainer, fused = trainer_step(name, b)
    t_fused, t_jax, t_tut = median_times([fused, jax_step(trainer, b), tutorial_step(name, b)], args.steps, args.warmup)
    return {
        "config": name,
        "mesh": "×".join(f"{k}={v}" for k, v in trainer.mesh.shape.items()),
        "trainer_ms": 1e3 * t_fused,
        "vs_jax": t_fused / t_jax,
        "tutorial_vs_trainer": t_tut / t_fused,
        "torch_vs_trainer": None if torch_s is None else torch_s / t_fused,
        "gemm_fraction": step_flops(args.batch) / t_fused / gemm,
        "bytes_per_device": per_device_bytes(trainer),
    }


def print_table(rows: list[dict[str, object]]) -> None:
    print(
        "| config | mesh | Trainer step (ms) | Trainer / hand-written JAX | tutorial pattern / Trainer "
        "| eager torch / Trainer | FLOP/s vs plain GEMM | params+Adam state per device (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        torch_ratio = "—" if r["torch_vs_trainer"] is None else f"{r['torch_vs_trainer']:.2f}×"
        print(
            f"| {r['config']} | {r['mesh']} | {r['trainer_ms']:.1f} | {r['vs_jax']:.2f}× | "
            f"{r['tutorial_vs_trainer']:.2f}× | {torch_ratio} | {r['gemm_fraction']:.0%} | "
            f"{r['bytes_per_device'] / 2**20:.2f} |"
        )


LLAMA = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
             vocab_size=8000, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
LLAMA_TINY = LLAMA | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=256)  # fmt: skip


def llama_config(tiny: bool):
    import transformers

    return transformers.LlamaConfig(**(LLAMA_TINY if tiny else LLAMA))


def llama_flops(config, batch: int, seq: int) -> float:
    """Model FLOPs of one train step: 6 × matmul params × tokens + attention (the causal square counted whole)."""
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    dim = h // heads
    per_layer = 2 * h * h + 2 * h * kv * dim + 3 * h * config.intermediate_size
    dense = 6 * (config.num_hidden_layers * per_layer + h * config.vocab_size) * batch * seq
    return dense + 12 * config.num_hidden_layers * batch * heads * seq * seq * dim


def llama_trainer(name: str, config, ids):
    import jax
    import optax
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if name == "one_device":
        mesh, rules = ts.make_mesh({"data": 1}, devices=jax.devices()[:1]), ts.presets.replicated()
    elif name == "fsdp":
        mesh, rules = ts.make_mesh({"data": -1}), ts.presets.hf_rules(model, axis=None)
    else:
        mesh, rules = ts.make_mesh({"data": -1, "model": 2}), ts.presets.hf_rules(model)
    optimizer = optax.adamw(1e-4, weight_decay=0.0)
    trainer = ts.Trainer(model, lambda m, i: m(input_ids=i, labels=i).loss, optimizer, ts.plan(model, mesh, rules))
    return trainer, optimizer, trainer.place_batch(ids)


def llama_row(name: str, args, config, ids) -> dict[str, object]:
    import jax_llama

    trainer, optimizer, placed = llama_trainer(name, config, ids)
    jitted, params, opt_state = jax_llama.step_fn(trainer, optimizer, config)
    held = {"state": (params, opt_state)}

    def hand_written():
        *held["state"], value = jitted(*held["state"], placed)
        return value

    t_trainer, t_jax = median_times([lambda: trainer.step(placed)["loss"], hand_written], args.steps, args.warmup)
    # the LM head's shape, the step's biggest matmul, timed 4x as often as the step (it is short)
    shape = (ids.numel(), config.hidden_size, config.vocab_size)
    gemm = gemm_flops_per_s(trainer.mesh, shape, 4 * args.steps, args.warmup)
    # both ran the same number of steps from the same weights: the baseline must compute the same step
    same = abs(float(trainer.step(placed)["loss"]) - float(hand_written())) < 1e-3
    return {
        "config": name,
        "mesh": "×".join(f"{k}={v}" for k, v in trainer.mesh.shape.items()),
        "trainer_s": t_trainer,
        "vs_jax": t_trainer / t_jax,
        "tflops": llama_flops(config, *ids.shape) / t_trainer / 1e12,
        "gemm_fraction": llama_flops(config, *ids.shape) / t_trainer / gemm,
        "same_loss": same,
    }


def print_llama_table(rows: list[dict[str, object]]) -> None:
    print("| config | mesh | Trainer step (s) | Trainer / hand-written JAX | model TFLOP/s | FLOP/s vs plain GEMM "
          "| same loss as JAX |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['mesh']} | {r['trainer_s']:.3f} | {r['vs_jax']:.2f}× | {r['tflops']:.3f} | "
              f"{r['gemm_fraction']:.0%} | {'yes' if r['same_loss'] else 'NO'} |")  # fmt: skip


def llama_table(args) -> None:
    import torch

    config = llama_config(args.tiny)
    batch, seq = (8, 32) if args.tiny else (16, 256)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    print(f"Llama: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, "
          f"batch {batch} × seq {seq}: {llama_flops(config, batch, seq) / 1e9:.1f} GFLOP per step")  # fmt: skip
    print_llama_table([llama_row(name, args, config, ids) for name in args.llama_configs.split(",")])


def main() -> int:
    args = parse_args()
    if args.cpu_devices:
        ts.use_cpu_devices(args.cpu_devices)
    import jax

    if "llama" in args.workloads.split(","):
        llama_table(args)
    if "mlp" not in args.workloads.split(","):
        return 0
    b = batch(args.batch)
    gemm = gemm_flops_per_s(ts.make_mesh({"data": -1}), (args.batch, 1024, 1024), args.steps, args.warmup)
    torch_s = None if args.no_torch else median_time(torch_step(b), args.steps, args.warmup)
    print(f"devices: {jax.device_count()} × {jax.devices()[0].platform}; batch {args.batch}; MLP {SIZES}; AdamW")
    torch_ms = "—" if torch_s is None else f"{1e3 * torch_s:.1f} ms"
    print(f"plain jitted GEMM: {gemm / 1e9:.1f} GFLOP/s; eager torch step: {torch_ms}")
    rows = [row(name, args, b, gemm, torch_s) for name in args.configs.split(",")]
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
