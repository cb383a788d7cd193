"""Multi-process test script: a save or export that fails on one process only ends on every process.

``python -m torchshard.launch --nproc 2 --cpu-devices-per-proc 1 tests/mp_save_script.py ROOT``: three cases in
turn, each under ``ROOT/failing=F``: F=2 names no process (every save succeeds), then F=0 and F=1, where process F
cannot create directories or files under that folder (a full disk, say). Every process catches the
`CheckpointError` of `save` and of `save_safetensors` (only process 0 writes export files), prints it, trains one
more step (all processes still in step), and goes on to the next case; it exits 0. One launch runs the three
cases, so the later ones also check that the processes still save together after a failed save.
"""

from __future__ import annotations

import errno
import os
import pathlib
import sys

import optax
import torch

import torchshard as ts


def main() -> None:
    ts.distributed.initialize()
    root = pathlib.Path(sys.argv[1])
    rank = ts.distributed.process_index()
    blocked: list[str] = []  # the folder this process cannot write under in the case running, if any
    mkdir, open_ = os.mkdir, os.open

    def full_disk(path, *args, **kwargs):
        if blocked and str(path).startswith(blocked[0]):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return mkdir(path, *args, **kwargs)

    def no_new_file(path, flags, *args, **kwargs):
        if blocked and flags & os.O_CREAT and str(path).startswith(blocked[0]):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return open_(path, flags, *args, **kwargs)

    os.mkdir = full_disk  # os.makedirs and pathlib's mkdir call it too
    os.open = no_new_file  # its shard file: the other process may have made the directories already

    model = torch.nn.Linear(4, 2)
    plan = ts.plan(model, ts.make_mesh({"data": 2}))
    trainer = ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.sgd(0.1), plan)
    batch = torch.ones(2, 4)
    trainer.step(batch)
    for failing in (2, 0, 1):
        case = root / f"failing={failing}"
        blocked[:] = [str(case)] if rank == failing else []
        for name, save in (
            ("save", lambda: ts.save(case / "ckpt", trainer)),
            ("export", lambda: ts.save_safetensors(case / "export", trainer)),
        ):
            try:
                save()
                print(f"failing={failing} {name}: saved", flush=True)
            except ts.CheckpointError as e:
                print(f"failing={failing} {name}: CheckpointError: {str(e).splitlines()[0]}", flush=True)
        print(f"failing={failing} after: loss {float(trainer.step(batch)['loss']):.6f}", flush=True)


if __name__ == "__main__":
    main()
