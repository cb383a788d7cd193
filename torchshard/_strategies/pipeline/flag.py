"""``python -m torchshard plan --compile --pipeline stage=4,microbatches=8,schedule=1f1b``: the pipeline's flag."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchshard._base.errors import ArgumentError
from torchshard._strategies.pipeline.option import Pipeline
from torchshard._train.strategy import Flag

_PIPELINE_KEYS = {"microbatches": int, "schedule": str, "repeats": int, "layers": str}


def parse(text: str, axes: dict[str, int]) -> Pipeline:
    """``--pipeline stage=4,microbatches=8,schedule=1f1b`` → a `Pipeline` over the mesh axis ``stage`` of size 4.

    The one pair whose key is not a `Pipeline` field names the stage axis and its size, which
    ``--mesh`` must give it too.

    Raises:
        ValueError: the command-line mistake, saying what to write.

    Examples:
        >>> parse("stage=2,microbatches=4,schedule=1f1b", {"stage": 2, "data": 4})
        Pipeline(axis='stage', microbatches=4, schedule='1f1b', repeats=1, layers=None)
    """
    fields: dict[str, Any] = {}
    axis: list[tuple[str, str]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"--pipeline {text!r}: write key=value pairs, e.g. stage=4,microbatches=8,schedule=1f1b")
        kind = _PIPELINE_KEYS.get(key)
        if kind is int and not value.isdigit():
            raise ValueError(f"--pipeline {text!r}: {key}={value!r} must be a positive integer")
        if kind is not None:
            fields[key] = kind(value)
        else:
            axis.append((key, value))
    if len(axis) != 1:
        raise ValueError(f"--pipeline {text!r}: name the stage axis and its size once, e.g. stage=4 (a --mesh axis)")
    (name, size), mesh = axis[0], ", ".join(f"{k}={v}" for k, v in axes.items())
    if axes.get(name) != (int(size) if size.isdigit() else size):
        raise ValueError(
            f"--pipeline {name}={size}: --mesh {mesh} gives no axis {name} of size {size}; add {name}={size} to --mesh"
        )
    try:
        return Pipeline(axis=name, **fields)
    except ArgumentError as err:
        raise ValueError(f"--pipeline {text!r}: {err}") from err


def _figures(pipeline: Pipeline, trainer: Any) -> dict[str, Any]:
    stages = trainer.mesh.shape[pipeline.axis]
    return dataclasses.asdict(pipeline) | {
        "stages": stages,
        "microbatches": pipeline.microbatches or stages,
        "bubble": trainer.idle_fraction,
    }


def _summary(pipe: dict[str, Any]) -> str:
    return (
        f", pipeline {pipe['schedule']} over {pipe['axis']}={pipe['stages']} × {pipe['microbatches']} "
        f"micro-batches (bubble {pipe['bubble']:.3f})"
    )


FLAG = Flag(
    metavar="AXIS=S,...",
    help="Trainer(pipeline=Pipeline(...)), e.g. stage=4,microbatches=8,schedule=1f1b (repeats=R, layers=REGEX; the "
    "axis as in --mesh)",
    parse=parse,
    figures=_figures,
    summary=_summary,
)
