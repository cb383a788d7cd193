"""``"gpipe"``: every micro-batch's forward through the stages, then the backward by the step's autodiff."""

from torchshard._strategies.pipeline.schedule import Schedule

SCHEDULE = Schedule(name="gpipe", summary="all forwards, then the backward by autodiff", searched=True)
