"""Multi-process test script: a save or export that fails on one process only ends on every process.

``python -m torchshard.launch --nproc 2 --cpu-devices-per-proc 1 tests/mp_save_script.py ROOT RANK``: process
RANK cannot create directories or files under ROOT (a full disk, say); every process catches the `CheckpointError` of
`save` and of `save_safetensors` (only process 0 writes
export files), prints it, trains one more step (all processes still in step), and exits 0.
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
    root, failing = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    rank = ts.distributed.process_index()
    if rank == failing:
        mkdir = os.mkdir

        def full_disk(path, *args, **kwargs):
            if str(path).startswith(str(root)):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return mkdir(path, *args, **kwargs)

        def no_new_file(path, flags, *args, **kwargs):
            if flags & os.O_CREAT and str(path).startswith(str(root)):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return open_(path, flags, *args, **kwargs)

        open_ = os.open
        os.mkdir = full_disk  # os.makedirs and pathlib's mkdir call it too
        os.open = no_new_file  # its shard file: the other process may have made the directories already

    model = torch.nn.Linear(4, 2)
    plan = ts.plan(model, ts.make_mesh({"data": 2}))
    trainer = ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.sgd(0.1), plan)
    batch = torch.ones(2, 4)
    trainer.step(batch)
    for name, save in (
        ("save", lambda: ts.save(root / "ckpt", trainer)),
        ("export", lambda: ts.save_safetensors(root / "export", trainer)),
    ):
        try:
            save()
            print(f"{name}: saved", flush=True)
        except ts.CheckpointError as e:
            print(f"{name}: CheckpointError: {str(e).splitlines()[0]}", flush=True)
    print(f"after: loss {float(trainer.step(batch)['loss']):.6f}", flush=True)


if __name__ == "__main__":
    main()
