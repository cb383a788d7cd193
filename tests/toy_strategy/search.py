"""The toy's ``plan --search`` hooks: the option a candidate gives it and its ``--tags`` choice."""

from __future__ import annotations

from torchshard._train.search_seam import SearchedLayout, SearchOption
from toy_strategy.option import Mark


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
