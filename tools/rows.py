"""A family's row of the conformance matrix: its eager model, checkpoint and Trainer, shared by its cells."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

import torchshard as ts
from testsupport import family_runs
from testsupport.helpers import torch_losses
from tools.cells import TYPED, Cell, Work, eager, first_line
from tools.families import Family, build, family, has_experts, lm_loss

NOT_MOE = Cell("n/a", "")  # a MoE column's cell on a dense family


def forward(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    out = model(input_ids=ids, labels=ids, use_cache=False)
    return {"loss": out.loss, "logits": out.logits}


def state_error(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same names (inf where they do not)."""
    if list(state) != list(expected):
        return float("inf")
    return max((float((state[n].double() - v.double()).abs().max()) for n, v in expected.items() if v.numel()),
               default=0.0)  # fmt: skip


class Row:
    """One family's shared pieces, each built on first use: the eager model, its checkpoint, the hf_rules Trainer."""

    def __init__(self, model_type: str, folder: Path) -> None:
        self.family: Family = family(model_type)
        self.original: Any = build(self.family).eval()  # the weights every reference starts from; never trained
        self.moe = self.family.moe or has_experts(self.original)
        self.folder = folder
        self.batch = family_runs.batches(seed=9)[0]  # for evaluate and the forward comparisons

    def fresh(self) -> torch.nn.Module:
        """A train-mode copy of the original model (eval mode where train mode samples: `Family.samples`)."""
        return copy.deepcopy(self.original).train(not self.family.samples)

    @functools.cached_property
    def plan_kind(self) -> str:
        """hf_rules (FSDP × TP); FSDP alone for a family without a tp_plan, which hf_rules refuses."""
        return "hf_rules" if getattr(self.original.config, "base_model_tp_plan", None) else "fsdp"

    @functools.cached_property
    def trainer(self) -> ts.Trainer:
        """The Trainer train steps, evaluate reads and load_safetensors fills."""
        return family_runs.trainer_for(self.fresh(), self.plan_kind)

    def noted(self, cell: Cell) -> Cell:
        """``cell``, saying so when it ran on FSDP alone or trained in eval mode."""
        notes = ("" if self.plan_kind == "hf_rules" else " (FSDP: no tp_plan)") + (
            f" (eval mode: {self.family.samples})" if self.family.samples else ""
        )
        return Cell(cell.status, cell.text + notes)

    @functools.cached_property
    def forward_refusal(self) -> str:
        """The typed error evaluate raises before any work ('' where it runs): torchshard refuses the forward."""
        try:
            self.trainer.evaluate(self.batch, forward)
        except TYPED as err:
            return f"{type(err).__name__}: {first_line(err)}"
        return ""

    @functools.cached_property
    def checkpoint(self) -> Path:
        """The original weights as transformers' save_pretrained writes them (from_pretrained's format)."""
        eager(self.original.save_pretrained, self.folder / "pretrained")
        return self.folder / "pretrained"

    @functools.cached_property
    def eager_losses(self) -> list[float]:
        """Eager torch's AdamW losses on the training batches (family_runs'): the truth of every training cell."""
        ref = self.fresh()
        return eager(torch_losses, ref, lm_loss, family_runs.torch_adamw(ref), family_runs.batches())

    @functools.cached_property
    def eager_outputs(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return forward(self.original, self.batch)

    @functools.cached_property
    def placed(self) -> torch.nn.Module:
        model = copy.deepcopy(self.original)
        axes, rules, _ = family_runs.rules(self.plan_kind, model)
        return ts.shard(model, ts.plan(model, ts.make_mesh(axes), rules))


def step_losses(trainer: ts.Trainer, batches: Iterable[Any], work: Work) -> list[float]:
    """Each batch's training loss; the cell's work has begun once the first step ran (a later error is a ✗)."""
    got = []
    for batch in batches:
        got.append(float(trainer.step(batch)["loss"]))
        work.began = True
    return got
