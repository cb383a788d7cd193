"""The matrix's strategy columns: each pipeline schedule, pipeline × context parallel, pipeline × all-to-all experts,
and scan_layers + remat under FSDP × TP, on every family, against eager torch (the train column's truth)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import optax
import test_families
import torch
from helpers import torch_losses
from jax.sharding import PartitionSpec as P

import torchshard as ts
from tools.cells import Cell, Work, eager, losses_cell
from tools.families import build, lm_loss
from tools.rows import NOT_MOE, Row, step_losses

SCHEDULES = ("gpipe", "circular", "1f1b", "1f1b_remat", "zero_bubble")
PIPELINE_AXES = {"stage": 2, "data": 4}  # FSDP over data inside each stage
CIRCULAR_LAYERS = 4  # two rounds over two stages need four layers


def _adamw() -> optax.GradientTransformation:
    f = test_families
    return optax.adamw(f.LR, b1=f.BETAS[0], b2=f.BETAS[1], eps=f.EPS, weight_decay=f.WEIGHT_DECAY)


def _trained(model: torch.nn.Module, axes: dict[str, int], rules: ts.Rules | None, work: Work, *,
             expected: list[float], **kwargs: Any) -> Cell:  # fmt: skip
    """``model`` trained on the train column's batches under ``axes``/``rules``/``kwargs``, against ``expected``."""
    trainer = ts.Trainer(model, lm_loss, _adamw(), ts.plan(model, ts.make_mesh(axes), rules), **kwargs)
    return losses_cell(step_losses(trainer, test_families._batches(), work), expected, test_families.RTOL)


def _fsdp() -> ts.Rules:
    return ts.presets.fsdp("data", min_size=1024)


def layers_pattern(model: torch.nn.Module) -> str:
    """A regex naming each of the model's decoder layers: the children of its longest ModuleList."""
    lists = [(len(m), name) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ts.ArgumentError(f"{type(model).__name__} has no ModuleList of layers to remat")
    return re.escape(max(lists)[1]) + r"\.\d+"


def _pipeline(schedule: str) -> Callable[[Row, Work], Cell]:
    def column(row: Row, work: Work) -> Cell:
        repeats = 2 if schedule == "circular" else 1
        pipeline = ts.Pipeline(microbatches=2, schedule=schedule, repeats=repeats)
        if schedule != "circular":
            return _trained(row.fresh(), PIPELINE_AXES, _fsdp(), work, expected=row.eager_losses, pipeline=pipeline)
        # two rounds over two stages: a model of four layers (its layer kinds alternating as in the two-layer one)
        model = build(row.family, layers=CIRCULAR_LAYERS).train(not row.family.samples)
        ref = build(row.family, layers=CIRCULAR_LAYERS).train(not row.family.samples)
        data = test_families._batches()
        expected = eager(torch_losses, ref, lm_loss, test_families._torch_adamw(ref), data)
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
    trainer = test_families.trainer_for(model, row.plan_kind, scan_layers=True, remat=layers_pattern(model))
    got = step_losses(trainer, test_families._batches(), work)
    return row.noted(losses_cell(got, row.eager_losses, test_families.RTOL))


# key → (heading, the check it states, the capability)
COMBOS: dict[str, tuple[str, str, Callable[[Row, Work], Cell]]] = {
    **{f"pp_{s}": (f"PP {s}", f"Pipeline(schedule={s!r}{', repeats=2' if s == 'circular' else ''}, microbatches=2) on "
                   f"stage=2 × data=4 (FSDP in stages{', 4 layers' if s == 'circular' else ''}); 4 AdamW steps, "
                   f"losses rtol {test_families.RTOL:.0e}", _pipeline(s)) for s in SCHEDULES},
    "pp_cp": ("PP × CP ring", "gpipe on stage=2 × data=2 × context=2, ContextParallel('ring'); losses rtol "
              f"{test_families.RTOL:.0e}", pipeline_context),
    "pp_a2a": ("PP × MoE all_to_all", "gpipe on stage=2 × expert=4, ExpertDispatch('all_to_all'); losses rtol "
               f"{test_families.RTOL:.0e}", pipeline_a2a),
    "scan_remat": ("scan + remat", "scan_layers=True, remat of every layer, under train's plan (FSDP × TP); losses "
                   f"rtol {test_families.RTOL:.0e}", scan_remat),
}  # fmt: skip
