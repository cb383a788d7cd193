"""``"1f1b_remat"``: gpipe's loop with each layer checkpointed: the least memory, one more forward per micro-batch."""

from torchshard._strategies.pipeline.schedule import Schedule

SCHEDULE = Schedule(
    name="1f1b_remat",
    summary="gpipe's order, each layer recomputed in the backward",
    in_flight=lambda stages, microbatches: 1,  # one layer's activations of one micro-batch at a time
    remats_each_layer=True,
)
