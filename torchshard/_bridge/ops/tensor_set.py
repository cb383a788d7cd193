"""``Tensor.set_(source)`` of a tensor onto itself: a no-op, as in torch; onto another tensor, refused by name.

``torch.nn.utils.parametrize.register_parametrization`` calls ``original.set_(original)`` when the
parametrization has no ``right_inverse``. peft's LoRA on transformers' stacked MoE experts (its
``ParamWrapper``, picked when ``target_modules`` names ``gate_proj``/``down_proj`` of an experts
module) registers one on every forward, so each step stopped with torchax's "no lowering for
aten::set_.source_Tensor". Pointing a tensor at *another* tensor's storage has no JAX meaning
(arrays share nothing that a later in-place write could reach), so that is refused rather than
copied with silently different aliasing.
"""

from __future__ import annotations

from typing import Any

import torch

from torchshard._base.errors import ShardingError
from torchshard._bridge.loaded import Environment
from torchshard._bridge.registry import register


def set_source(dest: Any, source: Any) -> Any:
    """``aten.set_.source_Tensor``: ``dest`` itself when ``source`` is ``dest`` (or holds the very same array)."""
    if source is dest or getattr(source, "_elem", None) is getattr(dest, "_elem", object()):
        return dest
    raise ShardingError(
        f"Tensor.set_(source) of a {tuple(dest.shape)} tensor onto another {tuple(source.shape)} tensor inside a "
        f"sharded model: JAX arrays share no storage, so the aliasing set_ makes cannot be kept; assign the "
        f"tensor (module.name = ...) or copy_ its values instead"
    )


def install(tx: Environment) -> None:
    """Registers the lowering in ``tx``."""
    register(tx, torch.ops.aten.set_.source_Tensor, set_source, jax_function=False, needs_env=False)
