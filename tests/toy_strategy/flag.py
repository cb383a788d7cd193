"""The toy's ``plan --compile --mark TAG`` flag."""

from __future__ import annotations

from torchshard._train.strategy import Flag
from toy_strategy.option import Mark

FLAG = Flag(
    metavar="TAG",
    help="Trainer(mark=Mark(TAG))",
    parse=lambda text, axes: Mark(text),
    figures=lambda option, trainer: {"tag": option.tag},
    summary=lambda figures: f", mark {figures['tag']}",
)
