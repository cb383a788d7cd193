"""``Trainer(pipeline=Pipeline(...))``: the option, checked as it is made, and resolved against a mesh and a stack."""

from __future__ import annotations

import dataclasses

from torchshard._base.validate import int_problems, raise_for_arguments, regex_problem
from torchshard._strategies.pipeline.schedule import DEFAULT_SCHEDULE
from torchshard._strategies.pipeline.schedules import SCHEDULES


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism over a model's stack of identical layers, for ``Trainer(..., pipeline=...)``.

    The stack (the ModuleList ``scan_layers=True`` finds, or the one ``layers`` names) is split into ``S * repeats``
    contiguous chunks of layers, ``S = mesh.shape[axis]``; a chunk's weights live only on the devices at its index
    of ``axis`` (sharded over the other axes as the plan says). Each batch is split into ``microbatches`` along dim
    0 and streamed through the stages; activations move between stages with ``ppermute``. Embeddings run before the
    loop; final norm, head and loss after it, or under ``"1f1b"`` in it, per micro-batch.

    Args:
        axis: the mesh axis the stages are laid along.
        microbatches: micro-batches per batch (at least the number of stages; default: one per stage).
        schedule: ``"gpipe"``: all forwards, then the backward by autodiff; ``"circular"``: chunk ``j``
            on stage ``j mod S``, and micro-batches go ``repeats`` times round the stages, which shrinks
            the idle fraction to ``(S-1)/(repeats*M + S-1)``; ``"1f1b"``: a forward and a backward per
            stage per iteration, each micro-batch's loss at the last stage (the step's loss is their
            mean, as with ``grad_accum_steps``): activations of ≤ ``2S-1`` micro-batches, no recompute;
            ``"1f1b_remat"``: gpipe's order, each layer recomputed in the backward: the least memory;
            ``"zero_bubble"``: 1F1B with each backward's weight-gradient half deferred, none a placeholder
            (bubble ``2(S-1)/(3M + 2(S-1))``; S more micro-batches of output cotangents kept).
        repeats: rounds of a circular schedule (1 for gpipe, 1f1b and zero_bubble).
        layers: regex (``re.fullmatch``) naming the ModuleList to pipeline, if the model has several.

    Raises:
        ArgumentError: an argument of the wrong type or value (all listed).

    Examples:
        >>> Pipeline(microbatches=8)
        Pipeline(axis='stage', microbatches=8, schedule='gpipe', repeats=1, layers=None)
        >>> Pipeline(microbatches=8, schedule="circular", repeats=2).bubble(stages=4)
        0.15789473684210525
    """

    axis: str = "stage"
    microbatches: int | None = None
    schedule: str = DEFAULT_SCHEDULE
    repeats: int = 1
    _: dataclasses.KW_ONLY
    layers: str | None = None

    def __post_init__(self) -> None:
        problems = [] if isinstance(self.axis, str) else [f"axis={self.axis!r} must be a mesh axis name"]
        problems += int_problems("microbatches", self.microbatches, minimum=1, none="one per stage")
        problems += int_problems("repeats", self.repeats, minimum=1)
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule={self.schedule!r} must be one of {list(SCHEDULES)}")
        elif not SCHEDULES[self.schedule].repeats and self.repeats != 1:
            takes = " or ".join(repr(name) for name, s in SCHEDULES.items() if s.repeats)
            problems.append(f"repeats={self.repeats!r} needs schedule={takes} ({self.schedule} makes one pass)")
        if self.layers is not None and (problem := regex_problem(self.layers)) is not None:
            problems.append(f"layers={self.layers!r} {problem}; name the ModuleList to pipeline, or pass None")
        raise_for_arguments(problems, header="invalid Pipeline arguments")

    def bubble(self, *, stages: int) -> float:
        """The idle fraction of the schedule on ``stages`` stages (its `Schedule.bubble`)."""
        return SCHEDULES[self.schedule].bubble(stages, self.microbatches or stages, self.repeats)
