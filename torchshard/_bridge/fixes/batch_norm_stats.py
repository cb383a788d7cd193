"""torchax's batch norm returns the batch statistics but never writes the running ones back."""

from __future__ import annotations

import torch

from torchshard._bridge.loaded import Environment
from torchshard._bridge.versions import Gate

# the 0.0.13 release and the 0.0.14 nightlies (checked: dev20261026) both drop the running stats
BATCH_NORM_STATS = Gate("https://github.com/google/torchax/issues/22", (0, 0, 14))


def _batch_norm_updating_stats(input, weight, bias, running_mean, running_var, training=False, momentum=0.1, eps=1e-5):
    """``aten.native_batch_norm`` in torch ops that, like torch, writes the running stats back."""
    dims = [0, *range(2, input.ndim)]
    shape = [1, -1] + [1] * (input.ndim - 2)
    if training:
        mean = input.mean(dims)
        centred = input - mean.reshape(shape)
        var = (centred * centred).mean(dims)
        if running_mean is not None:
            count = input.numel() // input.shape[1]
            with torch.no_grad():  # torch tracks the unbiased variance in running_var
                running_mean.copy_((1 - momentum) * running_mean + momentum * mean)
                running_var.copy_((1 - momentum) * running_var + momentum * var * count / max(count - 1, 1))
    else:
        mean, var = running_mean, running_var
    rstd = torch.rsqrt(var + eps)
    out = (input - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    if not training:
        mean, rstd = input.new_zeros((0,)), input.new_zeros((0,))
    return out, mean, rstd


def needs_batch_norm_fix() -> bool:
    """True for torchax releases whose batch norm drops the running statistics."""
    return BATCH_NORM_STATS.applies()


def install(tx: Environment) -> None:
    """Replaces ``aten.native_batch_norm`` in ``tx`` when the installed torchax has the bug."""
    if needs_batch_norm_fix():
        tx.override_op_definition(torch.ops.aten.native_batch_norm, _batch_norm_updating_stats)
