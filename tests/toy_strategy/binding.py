"""The toy's binding to the Trainer and its execution hook, with its flag and search hooks named."""

from __future__ import annotations

import dataclasses
from typing import Any

import torchshard as ts
from torchshard._base.validate import instance_problems, raise_for_arguments
from torchshard._train.strategy import Bound, Setting, Strategy
from toy_strategy.flag import FLAG
from toy_strategy.option import MARKS, Mark
from toy_strategy.search import TAGS, searched


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


STRATEGY = Strategy(keyword="mark", option=Mark, bind=bind, flag=FLAG, searched=searched, search_options=(TAGS,))
