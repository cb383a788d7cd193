"""Train the torchax tutorial's MLP on 8 devices (DP, DP × TP, FSDP) and compare it with eager torch."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import torchshard as ts

PLANS = ("dp", "tp", "fsdp")
SIZES = (784, 1024, 1024, 1024, 10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8192, help="global batch size")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of {PLANS}")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices (0: leave JAX as is)")
    parser.add_argument("--no-torch", action="store_true", help="skip the eager torch baseline")
    # At lr 1e-3 Adam, which divides each gradient by its own size, amplifies summation-order
    # differences to ~1e-3 within 10 steps; at the default 1e-4 the plans stay within ~1e-6 of torch.
    parser.add_argument("--rtol", type=float, default=1e-4, help="loss tolerance against eager torch")
    parser.add_argument("--checkpoint-dir", default=None, help="save each plan's trainer to DIR/<plan>/step_<N>")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue each plan from its latest checkpoint")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    return args


def build_model(seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(SIZES) - 2 else [])
    return nn.Sequential(*layers)


def make_batches(batch: int, steps: int):
    """A fixed random 'teacher' labels random inputs, so the loss has something to learn."""
    import torch

    g = torch.Generator().manual_seed(1234)
    teacher = torch.randn(SIZES[0], SIZES[-1], generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, SIZES[0], generator=g)
        out.append((x, (x @ teacher).argmax(-1)))
    return out


def loss_fn(model, batch):
    import torch.nn.functional as F

    x, y = batch
    return F.cross_entropy(model(x), y)


def rules_for(name: str):
    indices = [str(2 * i) for i in range(len(SIZES) - 1)]  # Sequential indices of the Linear layers
    return {
        "dp": lambda: ts.presets.data_parallel(),
        "tp": lambda: ts.presets.tensor_parallel(colwise=indices[0::2], rowwise=indices[1::2]),
        "fsdp": lambda: ts.presets.fsdp("data"),
    }[name]()


def mesh_for(name: str):
    return ts.make_mesh({"data": -1, "model": 2} if name == "tp" else {"data": -1})


def run_steps(step, batches, label: str) -> list[float]:
    """Runs ``step(batch) -> loss`` over the batches with a progress bar; reads the loss every 5 steps."""
    from tqdm import tqdm

    losses = []
    bar = tqdm(batches, desc=f"{label:>6}", unit="step", file=sys.stdout)
    for i, batch in enumerate(bar):
        losses.append(step(batch))
        if i % 5 == 4 or i == len(batches) - 1:
            bar.set_postfix(loss=f"{float(losses[-1]):.4f}")
    return [float(v) for v in losses]


def train_sharded(name: str, batches, args: argparse.Namespace) -> list[float]:
    """Trains one plan; with --checkpoint-dir saves every few steps, with --resume continues from the latest."""
    import optax

    model = build_model()
    plan = ts.plan(model, mesh_for(name), rules_for(name))
    print(f"\n== {name}: {plan!r} ==\n{plan.table()}", flush=True)
    trainer = ts.Trainer(model, loss_fn, optax.adamw(args.lr, weight_decay=0.01), plan)
    ckpt = os.path.join(args.checkpoint_dir, name) if args.checkpoint_dir else None
    if args.resume and ts.checkpoint_steps(ckpt):
        ts.load(ckpt, trainer)  # reshards onto this run's mesh and plan
        print(f"{name}: resumed at step {trainer.step_count}", flush=True)
    start = trainer.step_count
    counter = itertools.count(start + 1)

    def step(batch):
        loss = trainer.step(batch)["loss"]
        n = next(counter)  # not trainer.step_count: reading it would wait for every step
        if ckpt and (n % args.checkpoint_every == 0 or n == len(batches)):
            ts.save(ckpt, trainer, keep_last=2)
        return loss

    return [float("nan")] * start + run_steps(step, batches[start:], name)


def train_torch(batches, lr: float) -> list[float]:
    import torch

    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def step(batch):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        return loss.item()

    print("\n== torch: eager, unsharded, CPU ==", flush=True)
    return run_steps(step, batches, "torch")


def report(results: dict[str, list[float]], rtol: float) -> bool:
    names = list(results)
    print("\n" + " | ".join(["step", *(f"{n:>12}" for n in names)]))
    for step in range(len(results[names[0]])):
        print(" | ".join([f"{step:4d}", *(f"{results[n][step]:12.6f}" for n in names)]))
    if "torch" not in results:
        return True
    ok = True
    for name in names:
        if name == "torch":
            continue
        pairs = zip(results[name], results["torch"], strict=True)
        worst = max((abs(a - b) / abs(b) for a, b in pairs if not math.isnan(a)), default=0.0)
        ok &= worst <= rtol
        verdict = "ok" if worst <= rtol else "FAIL"
        print(f"{name:>5} vs eager torch: max relative loss difference {worst:.2e} (rtol {rtol:g}: {verdict})")
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    group = ts.distributed.initialize()  # joins a `python -m torchshard.launch` run; a no-op when run alone
    if args.cpu_devices and group.source == "single":
        ts.use_cpu_devices(args.cpu_devices)
    batches = make_batches(args.batch, args.steps)
    results = {name: train_sharded(name, batches, args) for name in args.plans.split(",")}
    if not args.no_torch and ts.distributed.is_main_process():
        results["torch"] = train_torch(batches, args.lr)
    return 0 if report(results, args.rtol) else 1


if __name__ == "__main__":
    sys.exit(main())
