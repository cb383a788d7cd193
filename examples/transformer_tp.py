"""Tensor-parallel + FSDP transformer layers in plain torch, trained sharded and checked against eager torch.

The torch port of the JAX tutorial's ``Attention`` / ``MLP`` / ``Layer``: q/k/v are
column-parallel and o row-parallel over ``"model"`` (each device owns whole heads), the MLP's
up projection is column- and its down projection row-parallel, and ``presets.fsdp("data")``
shards every weight's other dim over ``"data"``. The modules carry their layout as
``shard_rules``, and ``torchshard.constrain`` pins the activations (batch over ``"data"``,
heads over ``"model"``); on plain CPU tensors ``constrain`` is the identity, so the very same
modules run unsharded in eager torch, which is the reference the sharded losses must match.

Run::

    python examples/transformer_tp.py                       # hidden 1024, 16 heads, 2 layers
    python examples/transformer_tp.py --dim 64 --heads 4 --seq 8 --steps 3
"""

from __future__ import annotations

import argparse
import copy
import math
import sys

import optax
import torch
from torch import nn

import torchshard as ts
from torchshard import presets

BATCH = ("data", None, None)  # [batch, seq, dim]: batch over data, features whole
HEADS = ("data", "model", None, None)  # [batch, heads, seq, head_dim]: heads over model
MESHES = ({"data": 2, "model": 4}, {"data": 4, "model": 2})


class Attention(nn.Module):
    """Multi-head self-attention; q/k/v column-parallel and o row-parallel over ``"model"``."""

    # torch Linear weights are [out, in]: colwise splits out (whole heads), rowwise splits in
    shard_rules = [
        (r"(q|k|v)\.weight", ("model", None)),
        (r"o\.weight", (None, "model")),
    ]

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        return ts.constrain(x.view(b, s, self.heads, d // self.heads).transpose(1, 2), HEADS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        # einsum, as in the tutorial: torchax maps it to one jnp.einsum, whereas `@` on 4-d tensors
        # decomposes into reshapes to 3-d that merge the sharded batch and head dims (an all-gather)
        scores = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d // self.heads), dim=-1)
        out = ts.constrain(torch.einsum("bhqk,bhkd->bhqd", scores, v), HEADS)
        return self.o(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    """``dim → 4·dim → dim`` with ReLU; up column-parallel, down row-parallel over ``"model"``."""

    shard_rules = [
        (r"up\.weight", ("model", None)),
        (r"down\.weight", (None, "model")),
    ]

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Layer(nn.Module):
    """Residual attention then residual MLP, the residual stream sharded over the batch only."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention = Attention(dim, heads)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = ts.constrain(x + self.attention(x), BATCH)
        return ts.constrain(x + self.mlp(x), BATCH)


class Transformer(nn.Module):
    """A stack of `Layer` s."""

    def __init__(self, dim: int = 1024, heads: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = ts.constrain(x, BATCH)
        for layer in self.layers:
            x = layer(x)
        return x


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def batches(n: int, *, batch: int, seq: int, dim: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, seq, dim, generator=g), torch.randn(batch, seq, dim, generator=g)) for _ in range(n)]


def eager_losses(model: nn.Module, data: list, *, lr: float) -> list[float]:
    """The reference: plain, unsharded torch AdamW on CPU."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    out = []
    for b in data:
        opt.zero_grad()
        loss = mse(model, b)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def sharded_losses(model: nn.Module, data: list, *, lr: float, mesh_axes: dict[str, int]) -> list[float]:
    """The same training, sharded: TP from the modules' annotations, FSDP over ``"data"``."""

    mesh = ts.make_mesh(mesh_axes)
    plan = ts.plan(model, mesh, presets.fsdp("data", min_size=0))
    trainer = ts.Trainer(model, mse, optax.adamw(lr, weight_decay=0.0), plan)
    return [float(trainer.step(b)["loss"]) for b in data]


def compare(args: argparse.Namespace) -> list[tuple[str, list[float], list[float]]]:
    """(mesh, eager losses, sharded losses) for each mesh."""
    torch.manual_seed(0)
    model = Transformer(args.dim, args.heads, args.layers)
    data = batches(args.steps, batch=args.batch, seq=args.seq, dim=args.dim)
    expected = eager_losses(copy.deepcopy(model), data, lr=args.lr)
    rows = []
    for axes in MESHES:
        name = ",".join(f"{k}={v}" for k, v in axes.items())
        rows.append((name, expected, sharded_losses(copy.deepcopy(model), data, lr=args.lr, mesh_axes=axes)))
    return rows


def report(rows: list[tuple[str, list[float], list[float]]], *, rtol: float) -> bool:
    """Prints a step-by-step loss table; True when every sharded loss is within ``rtol`` of eager torch."""
    print(f"{'mesh':<16} {'step':>4} {'eager torch':>14} {'torchshard':>14} {'rel err':>10}")
    ok = True
    for name, expected, got in rows:
        for step, (e, g) in enumerate(zip(expected, got, strict=True)):
            err = abs(g - e) / max(abs(e), 1e-12)
            ok &= err <= rtol
            print(f"{name:<16} {step:>4} {e:>14.6f} {g:>14.6f} {err:>10.2e}{'' if err <= rtol else '  MISMATCH'}")
    return ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rtol", type=float, default=1e-4)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ts.use_cpu_devices(8)
    ok = report(compare(args), rtol=args.rtol)
    print("losses match eager torch" if ok else f"MISMATCH: a sharded loss differs from eager torch by > {args.rtol}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
