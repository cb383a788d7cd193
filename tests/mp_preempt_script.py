"""Multi-process test script: a run preempted by SIGTERM saves at one agreed step and exits 0; a second run resumes.

``python -m torchshard.launch --nproc 2 --cpu-devices-per-proc 2 tests/mp_preempt_script.py ROOT MODE``:
MODE ``preempt`` has process 1 send SIGTERM to the launcher (which forwards it to every process) after step 3, and
every process saves in the background when `ts.distributed.preempted` says so, then exits; ``resume`` loads the
latest step and trains the rest, then trains every step from scratch in a new Trainer (``full``: the uninterrupted
run, in the same launch to spare one, after the resume so that the resume still runs in fresh processes). Each
process writes ``ROOT/{preempt,resume,full}.rank{i}.json``: the losses by step and the steps it saw preempted.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time

import torchshard as ts

ts.distributed.initialize()

import optax  # noqa: E402
import torch  # noqa: E402

STEPS = 40


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)


def run(root: pathlib.Path, mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    plan = ts.plan(model, ts.make_mesh({"data": 4}), ts.presets.fsdp(min_size=0))
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    trainer = ts.Trainer(model, loss_fn, optax.adamw(1e-2), plan)
    if mode == "resume":
        ts.load(root / "ckpt", trainer)
    rank, losses, preempted_at = ts.distributed.process_index(), {}, None
    while trainer.step_count < STEPS:
        step = trainer.step_count
        losses[step] = float(trainer.step(batch(step))["loss"])
        if mode == "preempt" and rank == 1 and step == 3:
            os.kill(os.getppid(), signal.SIGTERM)  # the scheduler's notice, through the launcher
        if mode != "full" and ts.distributed.preempted(trainer):
            preempted_at = trainer.step_count
            ts.save(root / "ckpt", trainer, background=True)  # interpreter exit waits for it
            break
        if mode == "preempt":
            time.sleep(0.05)  # the signal arrives while training
    (root / f"{mode}.rank{rank}.json").write_text(json.dumps({"losses": losses, "preempted_at": preempted_at}))


def main(root: pathlib.Path, mode: str) -> None:
    for each in ("resume", "full") if mode == "resume" else (mode,):
        run(root, each)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2])
