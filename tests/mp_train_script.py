"""Multi-process test script: DP, TP and FSDP training on global and process-local batches; JSON per process.

Run under the launcher, e.g.
``python -m torchshard.launch --nproc 2 --cpu-devices-per-proc 4 tests/mp_train_script.py OUT_DIR``;
each process writes ``OUT_DIR/rank{i}.json`` with its losses and the final (gathered) params.
It imports `testsupport` from the clone: run it with the clone on ``PYTHONPATH`` (``python3 dev.py`` does).
"""

from __future__ import annotations

import json
import os
import sys

import torchshard as ts

ts.distributed.initialize()  # the launcher already did; a second call with the same setup is a no-op

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from testsupport.models import MLP  # noqa: E402

BATCH, STEPS = 16, 4


def setup(name: str):
    if name == "tp":
        mesh = ts.make_mesh({"data": 4, "model": 2})
        return mesh, ts.presets.tensor_parallel(colwise=["layers.0"], rowwise=["layers.1"])
    mesh = ts.make_mesh({"data": 8})
    return mesh, ts.presets.fsdp("data", min_size=256) if name == "fsdp" else ts.presets.data_parallel()


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 16, generator=g)) for _ in range(STEPS)]


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def gathered(model) -> dict[str, list[float]]:
    """Every param in full on every process: non-addressable shards come through process_allgather."""
    out = {}
    for name, p in model.named_parameters():
        full = multihost_utils.process_allgather(p.jax(), tiled=True)
        out[name] = np.asarray(full, dtype=np.float64).ravel().tolist()
    return out


def train(name: str) -> dict:
    """Alternates global-batch and process-local steps on one Trainer (one compilation per plan)."""
    torch.manual_seed(0)
    model = MLP()
    mesh, rules = setup(name)
    trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1, momentum=0.9), ts.plan(model, mesh, rules))
    rows = ts.distributed.local_batch_slice(BATCH, mesh)
    losses = []
    for i, (x, y) in enumerate(batches()):
        local = i % 2 == 1
        metrics = trainer.step((x[rows], y[rows]) if local else (x, y), local=local)
        losses.append(float(metrics["loss"]))
    x, y = batches()[0]  # evaluated on the global batch, then from each process's own rows
    evaluated = [
        float(trainer.evaluate((x, y))["loss"]),
        float(trainer.evaluate((x[rows], y[rows]), local=True)["loss"]),
    ]
    return {
        "losses": losses,
        "evaluated": evaluated,
        "rows": [rows.start, rows.stop],
        "params": gathered(trainer.model),
    }


def init() -> dict:
    """A model materialised directly sharded, with random init: the same values on any process layout."""
    mesh, rules = setup("tp")
    model = ts.init_sharded(MLP, mesh, rules, seed=3)
    return {"losses": [], "evaluated": [], "rows": [0, 0], "params": gathered(model)}


def main(out_dir: str) -> None:
    results = {name: train(name) for name in ("dp", "tp", "fsdp")}
    results["init_sharded"] = init()
    info = {"process_index": jax.process_index(), "process_count": jax.process_count(), "devices": jax.device_count()}
    with open(os.path.join(out_dir, f"rank{jax.process_index()}.json"), "w") as f:
        json.dump({**info, "results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1])
