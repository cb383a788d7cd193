"""peft LoRA for the LoRA tests and the matrix: the adapters, the loss, the plans and AdamW's settings."""

from __future__ import annotations

import torch

from torchshard import presets

LR, WD = 1e-3, 0.01
TARGETS = ["q_proj", "v_proj", "o_proj"]  # colwise and rowwise layers
RULES = {
    "fsdp": ({"data": 8}, lambda m: presets.fsdp(min_size=256)),
    "fsdp_tp": ({"data": 4, "model": 2}, lambda m: presets.hf_rules(m, fsdp_min_size=256)),
}


def lora(model: torch.nn.Module, targets: list[str] = TARGETS) -> torch.nn.Module:
    """``model`` with LoRA adapters (r=8) on the Linear layers named ``targets``."""
    import peft  # the tests skip without it; the matrix's LoRA cell fails naming it

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def lm_loss(model, ids):
    """transformers' causal LM loss."""
    return model(input_ids=ids, labels=ids).loss
