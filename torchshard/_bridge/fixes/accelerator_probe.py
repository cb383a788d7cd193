"""torch ≥ 2.15's optimizers ask the registered accelerator for its stream; torchax's "jax" device has none."""

from __future__ import annotations

from typing import Any

import torch

# torchax registers "jax" as torch's PrivateUse1 device and reports it available, but links no C++
# device runtime. torch 2.15's `Optimizer.step` (its graph-capture health check) then asks
# `torch.accelerator.current_stream()` and every eager CPU optimizer step raises "PyTorch is not
# linked with support for jax devices" (pytorch/xla#9730 is the same failure for XLA's device).
# torchax's own tensors never go through `torch.accelerator`, so telling it the device is not
# available restores eager torch and changes nothing torchax does.
BUG = "https://github.com/pytorch/xla/issues/9730"


def _accelerator() -> Any:
    probe = getattr(torch._C, "_accelerator_getAccelerator", None)
    return probe() if probe is not None else None


def stream_query_fails() -> bool:
    """True when torch's accelerator is torchax's "jax" device and asking it for a stream raises."""
    accelerator = _accelerator()
    if accelerator is None or accelerator.type != "jax":
        return False
    try:
        torch._C._accelerator_getStream(0)
    except RuntimeError:
        return True
    return False


def _not_available() -> bool:
    return False


def hide_streamless_accelerator() -> None:
    """Makes ``torch.accelerator.is_available()`` false while the "jax" device cannot give a stream."""
    if stream_query_fails():
        torch.get_device_module("jax").is_available = _not_available
