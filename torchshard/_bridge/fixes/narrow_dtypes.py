"""torchax asks JAX for 64-bit dtypes that JAX holds in 32 bits unless x64 is on, and JAX warns at each request.

Every ``dtype=torch.int64`` inside a step (``arange``, ``zeros``, ``.long()``, ``torch.tensor(n)``,
``F.one_hot``, ``max(dim)``'s indices, integer ``div(rounding_mode=)``, ``bucketize``) reached JAX
as int64, which JAX narrowed anyway, warning "Explicitly requested dtype int64 ... will be truncated
to dtype int32" each time, on every step of models such as Mistral. The policy is known (64-bit
narrowed unless ``jax_enable_x64``), so torchax is asked for the dtype JAX holds instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchshard._bridge.loaded import Environment, mappings
from torchshard._bridge.registry import register

_torch_to_jax: list[Callable[[torch.dtype], Any]] = []  # torchax's own map, once replaced


def held_dtype(dtype: torch.dtype) -> np.dtype:
    """torchax's JAX dtype for ``dtype`` as JAX holds it (int64 → int32, float64 → float32 unless x64 is on)."""
    return jax.dtypes.canonicalize_dtype(_torch_to_jax[0](dtype))


def _long() -> np.dtype:
    return jax.dtypes.canonicalize_dtype(np.int64)


def _tensor(original: Callable[..., Any]) -> Callable[..., Any]:
    def tensor(data: Any, *, dtype: Any = None, **kwargs: Any) -> Any:
        leaves = jax.tree.leaves(data)
        if dtype is None and leaves and type(leaves[0]) is int:  # torch infers int64 from Python ints
            dtype = _long()
        return original(data, dtype=dtype, **kwargs)

    return tensor


def _one_hot(original: Callable[..., Any]) -> Callable[..., Any]:
    def one_hot(tensor: jax.Array, num_classes: int = -1) -> jax.Array:
        if num_classes < 0:  # the class count is the data's: torchax's own (it needs a concrete tensor)
            return original(tensor, num_classes)
        return jax.nn.one_hot(tensor, num_classes, dtype=_long())

    return one_hot


def _reduce_with_index(values: Callable[..., Any], index: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_dim(x: jax.Array, dim: int, keepdim: bool = False) -> tuple[jax.Array, jax.Array]:
        if x.ndim == 0:  # torch accepts dim 0 / -1 of a scalar
            return x, jnp.zeros((), _long())
        return values(x, axis=dim, keepdims=keepdim), index(x, axis=dim, keepdims=keepdim).astype(_long())

    return reduce_dim


def _integer(x: Any) -> bool:
    return isinstance(x, int) or (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer))


def _div(original: Callable[..., Any]) -> Callable[..., Any]:
    def div(x: Any, y: Any, rounding_mode: str | None = None) -> Any:
        if rounding_mode not in ("floor", "trunc") or not (_integer(x) and _integer(y)):
            return original(x, y, rounding_mode=rounding_mode)
        # torchax's integer result, held as JAX holds int64
        out = jnp.floor_divide(x, y) if rounding_mode == "floor" else jnp.trunc(jnp.true_divide(x, y))
        return out.astype(_long())

    return div


def _bucketize(original: Callable[..., Any]) -> Callable[..., Any]:
    def bucketize(input: Any, boundaries: Any, *, out_int32: bool = False, right: bool = False, out: Any = None) -> Any:
        return original(input, boundaries, out_int32=True, right=right).astype(jnp.int32 if out_int32 else _long())

    return bucketize


def install(tx: Environment) -> None:
    """Makes torchax's torch → JAX dtype map (all its factories and casts use it) and the ops that name
    int64 themselves answer with the dtype JAX holds."""
    if not _torch_to_jax:  # the map is torchax's module function: replaced once for every environment
        _torch_to_jax.append(mappings.t2j_dtype)
        mappings.t2j_dtype = held_dtype
    register(tx, torch.tensor, _tensor(tx._ops[torch.tensor].func), jax_function=True, needs_env=False)
    one_hot = torch.nn.functional.one_hot
    register(tx, one_hot, _one_hot(tx._ops[one_hot].func), jax_function=True, needs_env=False)
    register(tx, torch.ops.aten.max.dim, _reduce_with_index(jnp.max, jnp.argmax), jax_function=True, needs_env=False)
    register(tx, torch.ops.aten.min.dim, _reduce_with_index(jnp.min, jnp.argmin), jax_function=True, needs_env=False)
    div = _div(tx._ops[torch.ops.aten.div].func)
    for overload in (torch.ops.aten.div.Tensor_mode, torch.ops.aten.div.Scalar_mode):
        register(tx, overload, div, jax_function=True, needs_env=False)
    bucketize = _bucketize(tx._ops[torch.ops.aten.bucketize].func)
    register(tx, torch.ops.aten.bucketize, bucketize, jax_function=True, needs_env=False)
