"""``F.linear`` and ``torch.matmul`` as one dot over flattened tokens (no transposed gradient copies)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshard._bridge.loaded import Environment
from torchshard._bridge.ops import tokens
from torchshard._bridge.registry import register


def _tokens_dot(x: jax.Array, w: jax.Array, w_contract: int) -> jax.Array:
    """``x[..., k]`` times the 2-D ``w`` over its dim ``w_contract``, with ``x``'s leading dims flattened first.

    Autodiff of the same dot on ``[batch, seq, k]`` gives the weight gradient two contracting
    dims (batch, seq); XLA on CPU then copies the ``[tokens, out]`` output gradient transposed
    before every weight-gradient dot (21 % of a 1-device Llama step). On ``[tokens, k]`` the
    weight-gradient dot has one contracting dim, which the dot kernel reads transposed in place.
    Under context parallelism the tokens are flattened sequence-chunk-major (`tokens.flatten`),
    so they stay sharded over the batch and context axes with several rows per device.
    """
    x, w = _promoted(x, w)
    out = jax.lax.dot_general(tokens.flatten(x), w, (((1,), (w_contract,)), ((), ())))
    return tokens.unflatten(out, x.shape)


def _promoted(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    dtype = jnp.result_type(*arrays)  # lax dots take one dtype; torchax's einsum promoted the same way
    return tuple(a.astype(dtype) for a in arrays)


def linear(input, weight, bias=None):
    """``F.linear`` (``input @ weight.T + bias``) as one dot over the flattened tokens (see `_tokens_dot`).

    ``weight`` stays in torch's ``[out, in]`` layout: the dot contracts its dim 1, so ``weight.T``
    is never materialised.
    """
    if weight.ndim == 2 and input.ndim >= 1 and input.shape[-1] != weight.shape[1]:
        raise ValueError(  # torch's words: jax's would name dot_general's contracting dims
            f"F.linear: mat1 and mat2 shapes cannot be multiplied: input {tuple(input.shape)} has "
            f"{input.shape[-1]} features, the weight {tuple(weight.shape)} takes {weight.shape[1]}"
        )
    if weight.ndim != 2 or input.ndim < 1 or not jnp.issubdtype(jnp.result_type(input, weight), jnp.floating):
        out = jnp.matmul(input, weight.T)  # 1-D weights and integer operands: torchax's own semantics
    else:
        out = _tokens_dot(input, weight, 1)
    return out if bias is None else out + bias


def matmul(x, y):
    """``torch.matmul`` as ``jnp.matmul``; ``[..., k] @ [k, n]`` over flattened tokens like `linear`.

    torch's version decomposes batched operands (e.g. [batch, heads, seq, dim]) into reshapes
    around ``bmm`` that merge the batch and head dims; GSPMD then gathers heads that a
    tensor-parallel attention had split.
    """
    if x.ndim > 2 and y.ndim == 2 and jnp.issubdtype(jnp.result_type(x, y), jnp.floating):
        return _tokens_dot(x, y, 0)
    return jnp.matmul(x, y)


def install(tx: Environment) -> None:
    """Registers both lowerings in ``tx`` under every torch name they have."""
    lowerings: dict[Any, Any] = {
        torch.nn.functional.linear: linear,
        torch.ops.aten.linear: linear,
        torch.matmul: matmul,
        torch.Tensor.matmul: matmul,
        torch.Tensor.__matmul__: matmul,
    }
    for op, impl in lowerings.items():
        register(tx, op, impl, jax_function=True, needs_env=False)
