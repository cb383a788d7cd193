"""How transformers families train in the tests and the matrix: batches, AdamW on both sides, plans, tolerance."""

from __future__ import annotations

from typing import Any

import optax
import torch
from jax.sharding import PartitionSpec as P

import torchshard as ts
from tools.families import lm_loss
from torchshard import presets

RTOL = 1e-4
STEPS = 4
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


def batches(seed: int = 1) -> list[torch.Tensor]:
    """`STEPS` batches of 8 rows of 16 token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (8, 16), generator=gen) for _ in range(STEPS)]


def torch_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Eager torch's AdamW, as `optax_adamw`."""
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def optax_adamw() -> optax.GradientTransformation:
    """The Trainer's AdamW, as `torch_adamw`."""
    return optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)


def rules(kind: str, model: torch.nn.Module) -> tuple[dict[str, int], ts.Rules, P]:
    """mesh axes, rules and batch spec of each kind of plan the families run under."""
    if kind == "fsdp":
        return {"data": 8}, presets.fsdp(min_size=1024), P("data")
    if kind == "hf_rules":
        return {"data": 4, "model": 2}, presets.hf_rules(model, fsdp_min_size=1024), P("data")
    if kind == "expert_model":  # experts split over "expert", tensor parallel over "model", no FSDP
        return {"expert": 4, "model": 2}, presets.hf_rules(model, expert_axis="expert", fsdp_axis=None), P("expert")
    # expert parallel over 4 experts, with the batch over both axes and FSDP over data
    expert_rules = presets.hf_rules(model, axis=None, expert_axis="expert", fsdp_min_size=1024)
    return {"data": 2, "expert": 4}, expert_rules, P(("data", "expert"))


def trainer_for(model: torch.nn.Module, kind: str, **kwargs: Any) -> ts.Trainer:
    """``model``'s Trainer under a kind of plan (`rules`), AdamW as `torch_adamw`; ``kwargs`` go to the Trainer."""
    axes, kind_rules, batch_spec = rules(kind, model)
    plan = ts.plan(model, ts.make_mesh(axes), kind_rules)
    return ts.Trainer(model, lm_loss, optax_adamw(), plan, batch_spec=batch_spec, **kwargs)
