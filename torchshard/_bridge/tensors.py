"""Torch tensors backed by jax arrays: wrapping, unwrapping, rebinding, and host copies in JAX's dtypes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import torch

from torchshard._bridge.env import env
from torchshard._bridge.loaded import Tensor, interop, mappings


def is_jax_tensor(value: Any) -> bool:
    """Whether ``value`` is a torchax tensor (a torch tensor backed by a ``jax.Array``)."""
    return isinstance(value, Tensor)


def wrap(array: jax.Array) -> torch.Tensor:
    """A torchax tensor viewing ``array`` (no copy)."""
    return Tensor(array, env())


def unwrap(value: Any) -> Any:
    """The ``jax.Array`` behind a torchax tensor; anything else unchanged."""
    return value.jax() if isinstance(value, Tensor) else value


def torch_view(tree: Any) -> Any:
    """Every jax array of ``tree`` as a torchax tensor (no copy)."""
    return interop.torch_view(tree)


def jax_view(tree: Any) -> Any:
    """Every torchax tensor of ``tree`` as its jax array (no copy)."""
    return interop.jax_view(tree)


def call_jax(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls a JAX function on torch tensors and returns torch tensors."""
    return interop.call_jax(fn, *args, **kwargs)


def set_array(tensor: torch.Tensor, array: jax.Array) -> None:
    """Points a torchax tensor at another array in place, so every holder (and tied alias) sees it."""
    tensor._elem = array  # type: ignore[attr-defined]  # private: torchax has no public setter


def rebind(tensors: Mapping[str, torch.Tensor], arrays: Mapping[str, jax.Array]) -> None:
    """`set_array` for every name of ``arrays``."""
    for name, array in arrays.items():
        set_array(tensors[name], array)


@contextlib.contextmanager
def bound(module: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, ``module``'s parameters and buffers named in ``values`` are those tensors.

    Tied names stay tied (binding one name of a tied tensor binds all).
    """
    # private: torch.func.functional_call wraps this, but cannot hand the module to a callable
    # that calls it with the user's own arguments, as loss_fn(model, batch) must
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(module, dict(values), tie_weights=True):
        yield


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU torch tensor as numpy, in the dtype JAX will hold (64-bit narrowed unless x64 is on)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jax.numpy.bfloat16)
    arr = t.numpy()
    held = jax.dtypes.canonicalize_dtype(arr.dtype)
    return arr if held == arr.dtype else arr.astype(held)


def jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The dtype JAX holds a torch tensor of ``dtype`` in (int64 → int32, complex128 → complex64 unless x64 is on)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(mappings.t2j_dtype(dtype)))


# numpy holds these as ml_dtypes types torch cannot take; torch has a dtype of the same name and width
_BY_BITS = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def to_torch(host: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A numpy array (from a jax array) as a writable CPU torch tensor of ``dtype``.

    Raises:
        TypeError: torch has no dtype for the array's (e.g. int4).
    """
    if host.dtype.name in _BY_BITS:
        same = getattr(torch, host.dtype.name)
        bits = np.int16 if host.dtype.itemsize == 2 else np.uint8
        return torch.from_numpy(host.view(bits).copy()).view(same).to(dtype)
    return torch.from_numpy(np.array(host)).to(dtype)  # a copy: torch warns on read-only numpy
