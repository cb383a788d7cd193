"""``"circular"``: chunk ``j`` of the layers on stage ``j mod S``; micro-batches go ``repeats`` times round the stages.

The bubble shrinks to ``(S-1)/(repeats·M + S-1)``; each layer is recomputed in the backward. The search
does not try it: it needs a split of the layers into ``S·repeats`` chunks the search does not choose.
"""

from torchshard._strategies.pipeline.schedule import Schedule

SCHEDULE = Schedule(
    name="circular",
    summary="chunk j on stage j mod S, repeats rounds, each layer recomputed",
    in_flight=lambda stages, microbatches: stages,  # only each layer's input of the micro-batches in the loop
    remats_each_layer=True,
    repeats=True,
    searchable=False,
)
