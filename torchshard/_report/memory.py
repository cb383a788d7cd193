"""Per-device training memory a plan implies: parameters, gradients, AdamW moments and buffers."""

from __future__ import annotations

import dataclasses

import torch

from torchshard._sharding.plan import ShardingPlan


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device for training with AdamW: params, grads, two moment copies, buffers."""

    params: int
    grads: int
    adamw_state: int
    buffers: int
    unsharded: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.adamw_state + self.buffers

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("params", self.params),
            ("grads", self.grads),
            ("AdamW state (2 copies)", self.adamw_state),
            ("buffers", self.buffers),
            ("total", self.total),
        ]


def training_memory(plan: ShardingPlan, model: torch.nn.Module) -> Memory:
    """Per-device training memory implied by ``plan`` (activations not included)."""
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    params = plan.bytes_per_device("param")
    grads = sum(e.bytes_per_device for e in plan.unique_entries() if e.kind == "param" and e.name in trainable)
    unsharded_grads = sum(e.total_bytes for e in plan.unique_entries() if e.kind == "param" and e.name in trainable)
    return Memory(params, grads, 2 * grads, plan.bytes_per_device("buffer"), plan.total_bytes() + 3 * unsharded_grads)
