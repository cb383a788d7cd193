"""The matrix's strategy columns: each pipeline schedule, pipeline × context parallel, pipeline × all-to-all experts,
and scan_layers + remat under FSDP × TP, on every family, against eager torch (the train column's truth).

The schedules are the registry's (``torchshard._strategies.pipeline.schedules``): a schedule registered there gets
its column with no line here."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from jax.sharding import PartitionSpec as P

import torchshard as ts
from testsupport import family_runs
from testsupport.helpers import torch_losses
from tools.cells import Cell, Work, eager, losses_cell
from tools.families import build, lm_loss
from tools.rows import NOT_MOE, Row, step_losses

PIPELINE_AXES = {"stage": 2, "data": 4}  # FSDP over data inside each stage
ROUNDS_LAYERS = 4  # a schedule that takes repeats runs two rounds over two stages: four layers


def _trained(model: torch.nn.Module, axes: dict[str, int], rules: ts.Rules | None, work: Work, *,
             expected: list[float], **kwargs: Any) -> Cell:  # fmt: skip
    """``model`` trained on the train column's batches under ``axes``/``rules``/``kwargs``, against ``expected``."""
    trainer = ts.Trainer(model, lm_loss, family_runs.optax_adamw(), ts.plan(model, ts.make_mesh(axes), rules), **kwargs)
    return losses_cell(step_losses(trainer, family_runs.batches(), work), expected, family_runs.RTOL)


def _fsdp() -> ts.Rules:
    return ts.presets.fsdp("data", min_size=1024)


def layers_pattern(model: torch.nn.Module) -> str:
    """A regex naming each of the model's decoder layers: the children of its longest ModuleList."""
    lists = [(len(m), name) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ts.ArgumentError(f"{type(model).__name__} has no ModuleList of layers to remat")
    return re.escape(max(lists)[1]) + r"\.\d+"


def schedules() -> dict[str, bool]:
    """Each registered pipeline schedule's name → whether it takes ``repeats`` (rounds over the stages)."""
    from torchshard._strategies.pipeline.schedules import SCHEDULES

    return {name: schedule.repeats for name, schedule in SCHEDULES.items()}


def _pipeline(schedule: str, rounds: bool) -> Callable[[Row, Work], Cell]:
    def column(row: Row, work: Work) -> Cell:
        pipeline = ts.Pipeline(microbatches=2, schedule=schedule, repeats=2 if rounds else 1)
        if not rounds:
            return _trained(row.fresh(), PIPELINE_AXES, _fsdp(), work, expected=row.eager_losses, pipeline=pipeline)
        # two rounds over two stages: a model of four layers (its layer kinds alternating as in the two-layer one)
        model = build(row.family, layers=ROUNDS_LAYERS).train(not row.family.samples)
        ref = build(row.family, layers=ROUNDS_LAYERS).train(not row.family.samples)
        data = family_runs.batches()
        expected = eager(torch_losses, ref, lm_loss, family_runs.torch_adamw(ref), data)
        return _trained(model, PIPELINE_AXES, _fsdp(), work, expected=expected, pipeline=pipeline)

    column.__name__ = f"pipeline_{schedule}"
    return column


def pipeline_context(row: Row, work: Work) -> Cell:
    """gpipe over 2 stages × ring attention over 2 context devices × 2 data shards: rows split inside the stages."""
    axes = {"stage": 2, "data": 2, "context": 2}
    return _trained(row.fresh(), axes, _fsdp(), work, expected=row.eager_losses, batch_spec=("data", "context"),
                    pipeline=ts.Pipeline(microbatches=2), context=ts.ContextParallel())  # fmt: skip


def pipeline_a2a(row: Row, work: Work) -> Cell:
    """gpipe over 2 stages × experts over 4 devices, tokens moved by all-to-all."""
    if not row.moe:
        return NOT_MOE
    model = row.fresh()
    rules = ts.presets.hf_rules(model, axis=None, expert_axis="expert", fsdp_axis=None)
    return _trained(model, {"stage": 2, "expert": 4}, rules, work, expected=row.eager_losses, batch_spec=P("expert"),
                    pipeline=ts.Pipeline(microbatches=2), expert_dispatch=ts.ExpertDispatch("all_to_all"))  # fmt: skip


def scan_remat(row: Row, work: Work) -> Cell:
    """scan_layers + remat of every layer under the train column's plan (FSDP × TP where the family has a tp_plan)."""
    model = row.fresh()
    trainer = family_runs.trainer_for(model, row.plan_kind, scan_layers=True, remat=layers_pattern(model))
    got = step_losses(trainer, family_runs.batches(), work)
    return row.noted(losses_cell(got, row.eager_losses, family_runs.RTOL))


Combo = tuple[str, str, Callable[[Row, Work], Cell]]  # (heading, the check it states, the capability)


def pipeline_combos() -> dict[str, Combo]:
    """A column per registered pipeline schedule, in the registry's order."""
    return {
        f"pp_{s}": (f"PP {s}", f"Pipeline(schedule={s!r}{', repeats=2' if rounds else ''}, microbatches=2) on "
                    f"stage=2 × data=4 (FSDP in stages{', 4 layers' if rounds else ''}); 4 AdamW steps, "
                    f"losses rtol {family_runs.RTOL:.0e}", _pipeline(s, rounds))
        for s, rounds in schedules().items()
    }  # fmt: skip


PAIRS: dict[str, Combo] = {
    "pp_cp": ("PP × CP ring", "gpipe on stage=2 × data=2 × context=2, ContextParallel('ring'); losses rtol "
              f"{family_runs.RTOL:.0e}", pipeline_context),
    "pp_a2a": ("PP × MoE all_to_all", "gpipe on stage=2 × expert=4, ExpertDispatch('all_to_all'); losses rtol "
               f"{family_runs.RTOL:.0e}", pipeline_a2a),
    "scan_remat": ("scan + remat", "scan_layers=True, remat of every layer, under train's plan (FSDP × TP); losses "
                   f"rtol {family_runs.RTOL:.0e}", scan_remat),
}  # fmt: skip


def combos() -> dict[str, Combo]:
    """key → `Combo`: a column per pipeline schedule registered now, then the pairs and scan + remat."""
    return {**pipeline_combos(), **PAIRS}


COMBOS = combos()  # the matrix's columns: every schedule torchshard registers as it is imported
