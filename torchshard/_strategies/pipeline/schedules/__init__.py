"""The pipeline schedules, one file each; a schedule registers here with one line."""

from torchshard._strategies.pipeline.schedule import SCHEDULES, register
from torchshard._strategies.pipeline.schedules import circular, gpipe, one_f_one_b, one_f_one_b_remat, zero_bubble

register(gpipe.SCHEDULE)
register(circular.SCHEDULE)
register(one_f_one_b.SCHEDULE)
register(one_f_one_b_remat.SCHEDULE)
register(zero_bubble.SCHEDULE)

__all__ = ["SCHEDULES"]
