"""The torchax tutorial's MLP, tensor-parallel on 8 CPU devices: plan, shard, and check the forward against torch.

The layers alternate column-parallel (weight ``[out, in]`` split on ``out``) and row-parallel
(split on ``in``) over the ``"model"`` axis, so the activation between a pair stays sharded and
only the row-parallel output needs a sum across ``"model"``; the batch is split over ``"data"``.

Run::

    python examples/mlp_forward.py              # batch 8192, as in the tutorial
    python examples/mlp_forward.py --batch 16   # quick
"""

from __future__ import annotations

import argparse
import itertools
import sys

import jax
import numpy as np
import torch
from torch import nn

import torchshard as ts

# isort: split
import torchax.interop  # after torchshard, whose import shim lets torchax 0.0.13 load on torch 2.13

SIZES = (784, 1024, 1024, 1024, 10)


class MLP(nn.Module):
    """Linear layers with ReLU between them."""

    def __init__(self, sizes: tuple[int, ...] = SIZES) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def tp_rules(n_layers: int) -> ts.Rules:
    """Even layers column-parallel, odd layers row-parallel, over ``"model"``."""
    names = [rf"layers\.{i}" for i in range(n_layers)]
    return ts.presets.tensor_parallel(colwise=names[0::2], rowwise=names[1::2])


def sharded_forward(model: nn.Module):
    """A jitted forward whose parameters are arguments (so they keep their shardings, not baked in as constants)."""
    params = dict(model.named_parameters())
    forward = torchax.interop.jax_jit(lambda p, x: torch.func.functional_call(model, p, (x,)))
    return lambda x: forward(params, x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8192, help="global batch size (a multiple of 4)")
    parser.add_argument("--tol", type=float, default=1e-5, help="max |error| relative to the output scale")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ts.use_cpu_devices(8)  # before anything starts JAX's backend
    mesh = ts.make_mesh({"data": 4, "model": 2})

    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(args.batch, SIZES[0])
    with torch.no_grad():
        expected = model(x).numpy()  # the truth: plain, unsharded torch on CPU

    plan = ts.plan(model, mesh, tp_rules(len(SIZES) - 1))
    print(plan.table())
    ts.shard(model, plan)
    print("\nlayers.0.weight [out, in], column-parallel:")
    jax.debug.visualize_array_sharding(model.layers[0].weight.jax())

    batch = ts.shard_batch(x, mesh)  # leading dim over "data"
    out = sharded_forward(model)(batch).jax()
    print(f"\noutput {tuple(out.shape)}, batch over 'data':")
    jax.debug.visualize_array_sharding(out)

    scale = max(1.0, float(np.abs(expected).max()))
    err = float(np.abs(np.asarray(out) - expected).max()) / scale
    ok = err <= args.tol
    print(f"\nsharded vs eager torch: max |error| / scale = {err:.2e} (tol {args.tol:g}): {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
