"""Multi-process test script for torchrun: ``torchrun ... tests/mp_torchrun_script.py ROOT MODE``.

The processes join through `ts.distributed.initialize()` reading torchrun's variables (devices per
process from ``TORCHSHARD_CPU_DEVICES``) and train a tiny MLP with AdamW under FSDP over every
device, saving a checkpoint after each step and resuming from the latest complete one
(`ts.checkpoint_steps`) when started again. MODE:

* ``train``: the plain run.
* ``crash``: process 1 kills itself (SIGKILL) after step 3 the first time (a marker file says
  whether it did); ``torchrun --max-restarts 1`` restarts the group, which resumes.
* ``preempt``: process 1 sends SIGTERM to its torchrun agent after step 3 (as a scheduler would);
  the agent forwards it, `ts.distributed.preempted` agrees on a step, every process saves and exits.
* ``dcp``: `ts.load_dcp` of the FSDP2 checkpoint in ``ROOT/fsdp2`` (saved after 4 steps), the
  remaining steps, then `ts.save_dcp` to ``ROOT/out`` (FSDP2 reads it back in the test); process 0
  also writes ``ROOT/dcp.json`` with the final state dict, and every process its bytes read.

Each process writes ``ROOT/MODE.from{first step}.rank{i}.json``: the losses by step, the steps it
started from and stopped at, and how the run was set up.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import time

import torchshard as ts

group = ts.distributed.initialize()

import jax  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

STEPS, BATCH = 8, 8


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def dcp(root: pathlib.Path) -> None:
    import logging

    read: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: read.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchshard").addHandler(handler)
    logging.getLogger("torchshard").setLevel(logging.INFO)
    net = model()
    plan = ts.plan(net, ts.make_mesh({"data": 2, "model": 2}), ts.presets.fsdp(min_size=0))
    trainer = ts.load_dcp(root / "fsdp2", ts.Trainer(net, loss_fn, optax.adamw(1e-2), plan))
    started = trainer.step_count
    losses = {s: float(trainer.step(batch(s))["loss"]) for s in range(started, STEPS)}
    ts.save_dcp(root / "out", trainer)
    state = {k: v.tolist() for k, v in ts.to_torch_state_dict(trainer).items()}
    rank = ts.distributed.process_index()
    read = [m for m in read if "read boxes" in m]
    (root / f"dcp.rank{rank}.json").write_text(json.dumps({"losses": losses, "started": started, "state": state,
                                                           "read": read}))  # fmt: skip


def main(root: pathlib.Path, mode: str) -> None:
    if mode == "dcp":
        return dcp(root)
    net = model()
    plan = ts.plan(net, ts.make_mesh({"data": -1}), ts.presets.fsdp(min_size=0))
    trainer = ts.Trainer(net, loss_fn, optax.adamw(1e-2), plan)
    ckpt, rank = root / f"{mode}.ckpt", ts.distributed.process_index()
    if ts.checkpoint_steps(ckpt):
        ts.load(ckpt, trainer)
    started, losses, marker = trainer.step_count, {}, root / f"{mode}.done-once"
    while trainer.step_count < STEPS:
        step = trainer.step_count
        losses[step] = float(trainer.step(batch(step))["loss"])
        ts.save(ckpt, trainer, keep_last=2)
        if mode != "train" and rank == 1 and step == 3 and not marker.exists():
            marker.write_text("")
            if mode == "crash":
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exit code of its own
            os.kill(os.getppid(), signal.SIGTERM)  # the agent forwards it to every worker
        if mode == "preempt" and ts.distributed.preempted(trainer):
            break
        if mode == "preempt":
            time.sleep(0.2)  # the signal arrives while training
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    info = {"losses": losses, "attempt": attempt, "started": started, "stopped": trainer.step_count,
            "source": group.source, "processes": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count()}  # fmt: skip
    (root / f"{mode}.from{started}.rank{rank}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2])
