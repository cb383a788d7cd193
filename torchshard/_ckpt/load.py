"""load: a checkpoint `save` wrote, read straight into the target's shardings (resharded onto any plan)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from torchshard._base.errors import CheckpointError, raise_if_any
from torchshard._base.validate import instance_problems, int_problems, raise_for_arguments
from torchshard._ckpt import pending
from torchshard._ckpt.datastate import data_problems, read_data, restore_data
from torchshard._ckpt.meta import checksum_problems, read_meta
from torchshard._ckpt.processes import together
from torchshard._ckpt.restore import (
    bind_module,
    destination,
    destination_arrays,
    load_trainer,
    model_item,
    recipes,
    tensor_problems,
    trainer_problems,
    trainer_read,
)
from torchshard._ckpt.shards import read_state
from torchshard._ckpt.state import Target, model_of, target_problems
from torchshard._ckpt.stepdir import STATE, PathLike, check_files, path_problems, recorded_sizes, resolve
from torchshard._sharding.plan import ShardingPlan
from torchshard._trainer.trainer import Trainer


def _check_load_args(path: Any, target: Any, step: Any, plan: Any, data: Any) -> None:
    problems = path_problems("path", path) + target_problems(target) + data_problems(data)
    problems += int_problems("step", step, minimum=0, none="the latest")
    if plan is not None:
        problems += instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    if plan is not None and isinstance(target, Trainer):
        problems.append("plan= is for modules; a Trainer loads onto its own plan (build it with the plan you want)")
    raise_for_arguments(problems, header="invalid load() arguments")


def load(
    path: PathLike, target: Target, *, step: int | None = None, plan: ShardingPlan | None = None, data: Any = None
) -> Target:
    """Restores a checkpoint written by `save` into ``target``, resharding onto its plan.

    Each array is read directly into the target's sharding, so a checkpoint saved on
    one mesh or plan loads onto any other. A Trainer gets its parameters, buffers, optimizer
    state, step counter and RNG base key back, so training resumes exactly. A module gets its
    tensors (a Trainer's checkpoint loads into a bare module too). Names and shapes are checked
    like torch's strict ``load_state_dict``, and every array's checksum is verified. A
    background save still writing is waited for first. With ``data=loader`` (on every process)
    each process's loader gets the state it saved, checked against its checksum, before the
    target changes.

    Args:
        path: a checkpoint root (the latest complete step is loaded) or one ``step_<N>`` directory.
        target: a `Trainer`, or a module: sharded already (loaded onto its tensors' current
            shardings) or, with ``plan=``, on any device (``meta`` included).
        step: load this step of the root instead of the latest.
        plan: for a module, the `ShardingPlan` to load onto.
        data: the object (``StatefulDataLoader``, sampler) whose ``load_state_dict`` gets this
            process's data state saved by ``save(..., data=...)``.

    Returns:
        ``target``, now holding the checkpoint's values.

    Raises:
        ArgumentError: bad arguments.
        ShardingError: names or shapes do not match (every missing, unexpected and mis-shaped
            tensor listed), or the optimizer state does not.
        CheckpointError: no complete checkpoint at ``path``, or it is truncated or corrupted;
            with ``data=``: the step holds no data state, was saved by another number of
            processes, or ``data.load_state_dict`` rejects it.

    Examples:
        >>> import tempfile, optax
        >>> root, model = tempfile.mkdtemp(), torch.nn.Linear(16, 4)
        >>> loss_fn = lambda m, b: m(b).square().mean()
        >>> trainer = ts.Trainer(model, loss_fn, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})))
        >>> _ = trainer.step(torch.randn(8, 16))
        >>> _ = ts.save(root, trainer)
        >>> other = torch.nn.Linear(16, 4)  # onto another mesh and plan
        >>> resumed = ts.Trainer(other, loss_fn, optax.sgd(0.1), ts.plan(other, ts.make_mesh({"data": 4, "model": 2}),
        ...                      [("weight", ("model", None))]))
        >>> load(root, resumed).step_count
        1
        >>> class Position:  # any object with state_dict() and load_state_dict(), e.g. a StatefulDataLoader
        ...     def __init__(self, seen=0): self.seen = seen
        ...     def state_dict(self): return {"seen": self.seen}
        ...     def load_state_dict(self, state): self.seen = state["seen"]
        >>> _ = ts.save(root, trainer, step=5, data=Position(seen=40))
        >>> load(root, resumed, data=(position := Position())).step_count, position.seen
        (1, 40)
    """
    _check_load_args(path, target, step, plan, data)
    pending.wait()
    step_dir = resolve(pathlib.Path(os.path.abspath(path)), step)
    meta = read_meta(step_dir)
    check_files(step_dir, recorded_sizes(meta))
    # every process reads its own file; all stop if any fails, before orbax's reads meet across processes
    data_state = together("torchshard-load-data", lambda: read_data(step_dir, meta) if data is not None else None)
    model = model_of(target)
    trainer = target if isinstance(target, Trainer) else None
    dest = destination(target, plan)
    problems = tensor_problems(meta, dest)
    recipes_ = recipes(meta, dest) if not problems else {}
    item = {"model": model_item(meta, dest, recipes_)}
    trainer_plan = None
    if trainer is not None and not problems:
        trainer_plan = trainer_read(meta, trainer, recipes_, item["model"])
        item["trainer"] = trainer_plan.item
    if trainer is not None:
        problems += trainer_problems(meta, trainer_plan) if not problems else []
    header = f"checkpoint {step_dir} ({meta.get('module')}) does not fit {type(model).__name__}"
    raise_if_any(problems, header=f"{header}; load it into the architecture (and optimizer) it was saved from")
    restored, sums = read_state(step_dir / STATE, item, step_dir=step_dir)
    raise_if_any(
        checksum_problems(meta, restored, sums),
        header=f"{step_dir} is corrupted; load an earlier step",
        error=CheckpointError,
    )
    arrays = destination_arrays(recipes_, restored["model"], dest)
    if data is not None:  # before the target changes: a loader that rejects its state leaves the target as it was
        restore_data(data, data_state, step_dir)
    if trainer is not None and trainer_plan is not None:
        load_trainer(trainer, arrays, trainer_plan.convert(restored["trainer"], trainer))
    else:
        bind_module(model, arrays, plan)
    return target
