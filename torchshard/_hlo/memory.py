"""What a compiled program holds in memory per device, from XLA's buffer assignment."""

from __future__ import annotations

import dataclasses

import jax

from torchshard._base.errors import ShardingError
from torchshard._base.format import columns, fmt_bytes

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
