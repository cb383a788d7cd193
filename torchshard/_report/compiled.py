"""What a compiled step holds in memory per device: arguments, temporaries, outputs and their peak."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from torchshard._base.errors import ShardingError
from torchshard._base.format import columns, fmt_bytes
from torchshard._train.trainer import Trainer

_EXPLAINED = {
    "argument_bytes": "arguments: params, optimizer state, buffers, batch",
    "temp_bytes": "temporaries: activations kept for the backward, grads, XLA scratch",
    "output_bytes": "outputs: the new train state and the metrics",
    "alias_bytes": "outputs written over donated arguments",
    "peak_bytes": "peak = arguments + outputs - aliased + temporaries",
}


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Bytes one device holds for a compiled program, from XLA's buffer assignment.

    ``peak_bytes = argument + output - alias + temp``: everything passed in stays allocated
    while the step runs, outputs that reuse a donated argument's buffer (``alias``) take no
    memory of their own, and ``temp`` is the one scratch block the program allocates (XLA
    packs every temporary into it, reusing space between buffers that are not live at once).
    XLA's own ``peak_memory_in_bytes`` is not used: on CPU it leaves the temp block out. What
    lives outside the step (the runtime, a prefetched next batch, allocator fragmentation) is
    not counted.

    Attributes:
        argument_bytes: inputs: params, optimizer state, buffers, the batch and the RNG key.
        temp_bytes: scratch: activations kept for the backward, gradients, collective buffers.
        output_bytes: results: the new train state and the metrics.
        alias_bytes: the part of ``output_bytes`` written over donated arguments.
        peak_bytes: the most the device holds at once while the program runs.

    Examples:
        >>> memory = CompiledMemory(argument_bytes=100, temp_bytes=30, output_bytes=104, alias_bytes=100,
        ...                         peak_bytes=134)
        >>> memory.margin(200), memory.fits(120)
        (66, False)
    """

    argument_bytes: int
    temp_bytes: int
    output_bytes: int
    alias_bytes: int
    peak_bytes: int

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> CompiledMemory:
        """The figures of ``compiled.memory_analysis()``."""
        stats = compiled.memory_analysis()
        if stats is None:
            raise ShardingError("this backend's compiler reports no memory analysis; compile for CPU devices instead")
        args, temp = stats.argument_size_in_bytes, stats.temp_size_in_bytes
        out, alias = stats.output_size_in_bytes, stats.alias_size_in_bytes
        return cls(int(args), int(temp), int(out), int(alias), int(args + out - alias + temp))

    def margin(self, device_memory: int) -> int:
        """``device_memory - peak_bytes``: room left (negative when it does not fit)."""
        return device_memory - self.peak_bytes

    def fits(self, device_memory: int) -> bool:
        """Whether the peak fits in ``device_memory`` bytes."""
        return self.margin(device_memory) >= 0

    def rows(self) -> list[tuple[str, int]]:
        """(what, bytes) per figure, in the order of the attributes."""
        return [(_EXPLAINED[f.name], getattr(self, f.name)) for f in dataclasses.fields(self)]

    def table(self) -> str:
        """One line per figure: what it counts and its size."""
        return "\n".join(columns([(what, fmt_bytes(n)) for what, n in self.rows()]))

    def __str__(self) -> str:
        return self.table()


def memory(target: Any, batch: Any = None) -> CompiledMemory:
    """Compiles a Trainer's step for ``batch`` and reports its memory per device; nothing runs.

    Args:
        target: a `Trainer` (or an `AbstractTrainer`, whose model need not exist, for a mesh of
            simulated devices), or a ``jax.stages.Lowered`` / ``Compiled`` (then no ``batch``).
        batch: as for ``trainer.step``; shapes alone (``jax.ShapeDtypeStruct``) for an `AbstractTrainer`.

    Returns:
        A `CompiledMemory`: argument, temp, output, aliased and peak bytes per device.

    Raises:
        ShardingError: ``target`` is none of the above, or a Trainer was given no batch.

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
            raise ShardingError("memory(trainer, batch): pass the batch the step is compiled for")
        target = target.lower(batch)
    if isinstance(target, jax.stages.Lowered):
        target = target.compile()
    if isinstance(target, jax.stages.Compiled):
        return CompiledMemory.of(target)
    raise ShardingError(
        f"memory() cannot read {type(target).__name__}; pass a torchshard.Trainer (or AbstractTrainer) and a batch, "
        f"or a jax Lowered/Compiled stage"
    )
