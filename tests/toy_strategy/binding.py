"""The toy's binding to the Trainer, its execution hook, its ``plan --compile`` flag and its search hooks."""

from __future__ import annotations

import dataclasses
from typing import Any

import torchshard as ts
from torchshard._base.validate import instance_problems, raise_for_arguments
from torchshard._train.search_seam import SearchOption
from torchshard._train.strategy import Bound, Flag, SearchedLayout, Setting, Strategy
from toy_strategy.option import MARKS, Mark


@dataclasses.dataclass(frozen=True)
class MarkRunner:
    """Runs the stack as the plain scan does, logging a marker first (the execution hook)."""

    tag: str
    count: int
    axis: str | None = None

    def order(self) -> tuple[int, ...]:
        return tuple(range(self.count))

    def run(self, scan: Any, pure: Any, h: Any, others: Any) -> Any:
        MARKS.append(f"{self.tag}:{scan.group.prefix}")
        return scan.scanned(pure, h, others)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Marked(Bound):
    """A `Mark` bound to a model with a scanned stack: the stack gets the toy's runner."""

    option: Mark

    def rewrite(self, setting: Setting) -> Setting:
        first, *rest = setting.groups
        marked = dataclasses.replace(first, runner=MarkRunner(self.option.tag, first.count))
        return dataclasses.replace(setting, groups=(marked, *rest))


def bind(option: Any, setting: Setting) -> Bound:
    """``Trainer(mark=)``: checked before anything moves.

    Raises:
        ArgumentError: ``option`` is not a `Mark`.
        ShardingError: the model has no scanned stack.
    """
    if option is None:
        return Bound()
    raise_for_arguments(instance_problems("mark", option, Mark, "None or a Mark"), header="invalid Trainer arguments")
    if not setting.groups:
        raise ts.ShardingError("Mark: no scanned stack to mark; pass scan_layers=True")
    return Marked(option=option)


def searched(layout: SearchedLayout) -> Mark | None:
    """A ``plan --search`` candidate's option: marked on meshes with data parallelism, with the tag tried there."""
    return Mark(layout.option("tag", "searched")) if layout.axes.get("data", 1) > 1 else None


def tagged(axes: dict[str, int], tag: str) -> dict[str, str]:
    """The layout option one ``--tags`` value sets: a tag on meshes with data parallelism, none elsewhere."""
    return {"tag": tag} if axes.get("data", 1) > 1 else {}


TAGS = SearchOption(
    name="tags",
    help="Mark tags to try on meshes with data parallelism",
    tried=lambda: ("searched",),
    allowed=lambda: ("searched", "other"),
    keys=("tag",),
    sets=tagged,
)


FLAG = Flag(
    metavar="TAG",
    help="Trainer(mark=Mark(TAG))",
    parse=lambda text, axes: Mark(text),
    figures=lambda option, trainer: {"tag": option.tag},
    summary=lambda figures: f", mark {figures['tag']}",
)
STRATEGY = Strategy(keyword="mark", option=Mark, bind=bind, flag=FLAG, searched=searched, search_options=(TAGS,))
