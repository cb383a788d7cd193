"""Multi-process test script: each process's StatefulDataLoader resumes where it stopped, through ``save(data=)``.

``python -m torchshard.launch --nproc 2 --cpu-devices-per-proc 4 tests/mp_data_script.py ROOT MODE``: each
process shuffles its own 12 rows (3 batches an epoch) and feeds them as its part of the global batch. MODE
``first`` trains 4 steps (mid-epoch 2), saves in the background with ``data=loader`` and exits; ``resume`` builds a
new Trainer and loader (other seeds), loads with ``data=loader`` and trains the rest, then trains every step with a
new Trainer and loader (``full``: the uninterrupted run, in the same launch to spare one, after the resume so that
the resume still runs in fresh processes). Each process writes ``ROOT/{first,resume,full}.rank{i}.json``: the row
ids of each step's batch and the losses.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torchshard as ts

ts.distributed.initialize()

import optax  # noqa: E402
import torch  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import RandomSampler  # noqa: E402

ROWS, BATCH, STEPS, STOP = 12, 4, 8, 4


def loader(rank: int, seed: int) -> StatefulDataLoader:
    g = torch.Generator().manual_seed(0)  # the same global rows everywhere; each process takes its own
    ids, x, y = torch.arange(2 * ROWS), torch.randn(2 * ROWS, 32, generator=g), torch.randn(2 * ROWS, 16, generator=g)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    rows = torch.utils.data.TensorDataset(ids[mine], x[mine], y[mine])
    return StatefulDataLoader(
        rows, batch_size=BATCH, sampler=RandomSampler(rows, generator=torch.Generator().manual_seed(seed))
    )


def batches(data: StatefulDataLoader):
    while True:  # epoch after epoch
        yield from data


def run(root: pathlib.Path, mode: str) -> None:
    rank = ts.distributed.process_index()
    torch.manual_seed(0 if mode != "resume" else 1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    plan = ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=0))
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[1]), b[2])  # noqa: E731
    trainer = ts.Trainer(model, loss_fn, optax.adamw(1e-2), plan)
    data = loader(rank, seed=10 + rank if mode != "resume" else 99)
    if mode == "resume":
        ts.load(root / "ckpt", trainer, data=data)
    seen, losses, drawn = {}, {}, batches(data)
    while trainer.step_count < (STOP if mode == "first" else STEPS):  # a batch drawn is a batch trained on
        step, batch = trainer.step_count, next(drawn)
        seen[step] = batch[0].tolist()
        losses[step] = float(trainer.step(batch, local=True)["loss"])
    if mode == "first":
        ts.save(root / "ckpt", trainer, data=data, background=True)  # interpreter exit waits for it
    (root / f"{mode}.rank{rank}.json").write_text(json.dumps({"seen": seen, "losses": losses}))


def main(root: pathlib.Path, mode: str) -> None:
    for each in ("resume", "full") if mode == "resume" else (mode,):
        run(root, each)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2])
