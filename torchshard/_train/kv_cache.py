"""A training step builds no KV cache: transformers modules' ``config.use_cache`` is off while it is traced."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def no_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, every ``config.use_cache`` of ``model``'s modules is False; restored after.

    transformers configs default to ``use_cache=True``, and a forward that is not told otherwise
    then builds a ``DynamicCache`` of every layer's keys and values: work and memory a training step
    never reads, and a Python object a scanned layer cannot carry (the step failed with
    ``scan_layers``). An explicit ``use_cache=True`` in the call still wins, as in transformers.
    """
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True
