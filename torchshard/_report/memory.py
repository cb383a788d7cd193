"""Per-device training memory a plan implies: parameters, gradients, AdamW moments and buffers."""

from __future__ import annotations

import dataclasses
import math

import torch

from torchshard._sharding.plan import PlanEntry, ShardingPlan, fullest_device_bytes


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


def _stored(entry: PlanEntry, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a parameter is kept in: ``param_dtype`` (a `MixedPrecision`'s master copy) for floating ones."""
    if param_dtype is None or entry.kind != "param" or not entry.dtype.is_floating_point:
        return entry.dtype
    return param_dtype


def training_memory(plan: ShardingPlan, model: torch.nn.Module, *, param_dtype: torch.dtype | None = None) -> Memory:
    """Per-device training memory implied by ``plan`` (activations not included).

    Args:
        plan: the plan of ``model``.
        model: tells trainable parameters (they have grads and optimizer state) from frozen ones.
        param_dtype: the dtype floating parameters are stored in (``MixedPrecision.param_dtype``);
            None keeps the model's own.

    Examples:
        >>> model = torch.nn.Linear(1024, 1024, dtype=torch.bfloat16)
        >>> p = ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp())
        >>> training_memory(p, model).params, training_memory(p, model, param_dtype=torch.float32).params
        (264192, 528384)
    """
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    entries = plan.unique_entries()
    size = lambda e, n: n * _stored(e, param_dtype).itemsize  # noqa: E731
    per_device = {e.name: size(e, math.prod(e.shard_shape)) for e in entries}
    whole = {e.name: size(e, math.prod(e.shape)) for e in entries}
    params = [e for e in entries if e.kind == "param"]
    trained = [e for e in params if e.name in trainable]
    held = lambda e: per_device[e.name]  # noqa: E731
    grads, unsharded_grads = fullest_device_bytes(trained, held), sum(whole[e.name] for e in trained)
    unsharded = sum(whole.values()) + 3 * unsharded_grads
    return Memory(fullest_device_bytes(params, held), grads, 2 * grads, plan.bytes_per_device("buffer"), unsharded)
