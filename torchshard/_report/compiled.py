"""What a Trainer's compiled step holds in memory per device (the figures: `torchshard._hlo.memory`)."""

from __future__ import annotations

from typing import Any

import jax

from torchshard._base.errors import ArgumentError
from torchshard._hlo.memory import CompiledMemory
from torchshard._report.inspection import unreadable
from torchshard._trainer.trainer import Trainer


def memory(target: Any, batch: Any = None) -> CompiledMemory:
    """Compiles a Trainer's step for ``batch`` and reports its memory per device; nothing runs.

    Args:
        target: a `Trainer` (or an `AbstractTrainer`, whose model need not exist, for a mesh of
            simulated devices), or a ``jax.stages.Lowered`` / ``Compiled`` (then no ``batch``).
        batch: as for ``trainer.step``; shapes alone (``jax.ShapeDtypeStruct``) for an `AbstractTrainer`.

    Returns:
        A `CompiledMemory`: argument, temp, output, aliased and peak bytes per device.

    Raises:
        ArgumentError: ``target`` is none of the above (a torch module, say), or a Trainer was given no batch.

    Examples:
        >>> import optax
        >>> model = torch.nn.Linear(256, 256)
        >>> p = ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=1024))
        >>> trainer = ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.adamw(1e-3), p)
        >>> mem = memory(trainer, torch.randn(64, 256))
        >>> mem.argument_bytes >= 3 * 256 * 256 * 4 // 8  # weight, Adam's mu and nu, each 1/8 per device
        True
        >>> mem.alias_bytes >= 3 * 256 * 256 * 4 // 8  # donated: the new state overwrites the old
        True
    """
    if isinstance(target, Trainer):
        if batch is None:
            raise ArgumentError("memory(trainer, batch): pass the batch the step is compiled for")
        target = target.lower(batch)
    if isinstance(target, jax.stages.Lowered):
        target = target.compile()
    if isinstance(target, jax.stages.Compiled):
        return CompiledMemory.of(target)
    raise unreadable(
        "memory", target, "a torchshard.Trainer (or AbstractTrainer) and a batch, or a jax Lowered/Compiled stage"
    )
