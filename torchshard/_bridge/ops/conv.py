"""Depthwise 1-D convolutions as a few shifted multiply-adds.

Mamba, linear-attention and hybrid models (bamba, falcon_h1, nemotron_h, qwen3_next, kimi_linear, ...)
run a short causal ``Conv1d`` with ``groups == channels`` before their mixer. As an XLA
convolution its weight gradient is a convolution with ``batch_group_count``, which XLA on CPU
emits as a naive loop kernel: a tiny model's sharded step then ran for many minutes, devices
reaching the next collective so far apart that XLA aborted on its rendezvous timeout. With K taps
(4 in these models) the same convolution is K slices of the padded input, each scaled per channel
and summed, and its gradients are slices and reductions, which every backend runs well.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshard._bridge.loaded import Environment
from torchshard._bridge.registry import register

MAX_TAPS = 16  # longer kernels stay XLA convolutions: K slices would cost more than they save


def _depthwise_1d(
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    groups: int,
    x: Any,
    w: Any,
) -> bool:
    """Whether ``aten.convolution``'s arguments describe a stride-1 depthwise 1-D conv with few taps."""
    return (
        not transposed
        and w.ndim == 3
        and x.ndim in (2, 3)
        and w.shape[1] == 1
        and groups == w.shape[0] == x.shape[-2]
        and list(stride) == [1]
        and len(padding) == len(dilation) == 1
        and w.shape[-1] <= MAX_TAPS
    )


def depthwise_conv1d(x: jax.Array, w: jax.Array, bias: jax.Array | None, padding: int, dilation: int) -> jax.Array:
    """``F.conv1d(x, w, bias, padding=padding, dilation=dilation, groups=channels)`` as shifted sums.

    Examples:
        >>> x, w = jnp.arange(6.0).reshape(1, 2, 3), jnp.ones((2, 1, 2))
        >>> depthwise_conv1d(x, w, None, padding=1, dilation=1)[0].tolist()
        [[0.0, 1.0, 3.0, 2.0], [3.0, 7.0, 9.0, 5.0]]
    """
    taps = w.shape[-1]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(padding, padding)])
    length = padded.shape[-1] - dilation * (taps - 1)
    dtype = jnp.result_type(x, w)
    shifted = (jax.lax.slice_in_dim(padded, k * dilation, k * dilation + length, axis=-1) for k in range(taps))
    out = functools.reduce(jnp.add, (s.astype(dtype) * w[:, 0, k, None] for k, s in enumerate(shifted)))
    return out if bias is None else out + bias[:, None]


def convolution(reference: Callable[..., Any]) -> Callable[..., Any]:
    """``aten.convolution``: depthwise 1-D convs as `depthwise_conv1d`, every other one by ``reference``."""

    def lowering(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
        if _depthwise_1d(stride, padding, dilation, transposed, groups, x, w):
            return depthwise_conv1d(x, w, bias, padding=padding[0], dilation=dilation[0])
        return reference(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)

    return lowering


def install(tx: Environment) -> None:
    """Registers the lowering in ``tx``, torchax's own kept for every other convolution."""
    op = torch.ops.aten.convolution
    reference = tx._ops[op].func  # private: torchax's own lowering, kept as the fallback
    register(tx, op, convolution(reference), jax_function=True, needs_env=False)
