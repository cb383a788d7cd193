"""Pipelines under FSDP inside the stages: weights gathered and gradients reduced once per step, not per iteration."""

from __future__ import annotations

import pytest
from test_pipeline import FSDP, adamw, batches, blocks, blocks_loss

import torchshard as ts
from torchshard import Pipeline
from torchshard.inspect import CollectiveStats, collectives

MESH = {"stage": 4, "data": 2}
SCHEDULES = {
    "gpipe": Pipeline(microbatches=4),
    "1f1b": Pipeline(microbatches=4, schedule="1f1b"),
    "circular": Pipeline(microbatches=4, schedule="circular", repeats=2),
    "zero_bubble": Pipeline(microbatches=4, schedule="zero_bubble"),
}


def compiled_stats(pipeline: Pipeline | None) -> tuple[CollectiveStats, int]:
    model = blocks()
    plan = ts.plan(model, ts.make_mesh(MESH), FSDP)
    trainer = ts.Trainer(model, blocks_loss, adamw(), plan, pipeline=pipeline)
    compiled = trainer.lower(batches(1)[0]).compile()
    return collectives(compiled, mesh=plan.mesh), compiled.memory_analysis().temp_size_in_bytes


def off_stage(stats: CollectiveStats) -> int:
    """Bytes per device per step over every axis group but the stage axis alone (FSDP's and DP's traffic)."""
    return sum(n for over, n in stats.per_axes.items() if over != "stage")


@pytest.fixture(scope="module")
def unpipelined() -> int:
    return off_stage(compiled_stats(None)[0])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_fsdp_traffic_per_step_is_the_unpipelined_steps(schedule, unpipelined):
    stats, _ = compiled_stats(SCHEDULES[schedule])
    # the loop runs 7 (circular 11) iterations of 2 (1) layers: per iteration, it would be ≥ 4× as much
    assert off_stage(stats) <= 1.1 * unpipelined, (schedule, stats.per_axes, unpipelined)
    # gathered once: no all-gather over data inside a loop
    assert stats.step_bytes("all-gather", axes="data") == stats.nbytes("all-gather", axes="data") > 0
