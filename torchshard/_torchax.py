"""The one bridge to torchax: its import, its environment, tensor wrapping, and every private internal used."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import torch

from torchshard import _compat, _init_ops, _lowerings, _moe_ops

with _compat.import_shim():
    # torchax imports these lazily when its first environment is created; importing them here,
    # inside the shim's window, keeps the window closed afterwards and creates no environment
    # (which would start the JAX backend).
    for _name in ("torchax", "torchax.decompositions", "torchax.amp", "torchax.interop"):
        importlib.import_module(_name)

import torchax
from torchax import amp, interop
from torchax.ops import mappings, ops_registry
from torchax.tensor import Environment, Tensor

_fixed_envs: set[int] = set()


def env() -> Environment:
    """torchax's default environment with torchshard's lowerings, created on first use (starts the JAX backend)."""
    tx = torchax.default_env()
    if id(tx) not in _fixed_envs:
        _install_lowerings(tx)
        _fixed_envs.add(id(tx))
    return tx


def _register(tx: Environment, op: Any, impl: Callable[..., Any], *, jax_function: bool, needs_env: bool) -> None:
    # private: torchax's public override_op_definition registers torch-level functions only;
    # a JAX-level one needs its Operator record in the env's op table.
    tx._ops[op] = ops_registry.Operator(
        op, impl, is_jax_function=jax_function, is_user_defined=True, needs_env=needs_env, is_view_op=False
    )


def _install_lowerings(tx: Environment) -> None:
    tx.dispatch = _honouring_torch_autocast(tx, tx.dispatch)
    for op, impl in _compat.torch_op_fixes().items():
        tx.override_op_definition(op, impl)
    tx.override_op_definition(torch.ops.aten.normal_, _init_ops.normal_)
    for op, impl in {**_lowerings.jax_lowerings(), **_moe_ops.jax_lowerings()}.items():
        _register(tx, op, impl, jax_function=True, needs_env=False)
    for op in _lowerings.ATTENTION_OPS:
        reference = tx._ops[op].func  # private: torchax's own lowering, kept as the fallback
        _register(tx, op, _lowerings.attention(reference, interop.call_jax), jax_function=False, needs_env=True)
    for op in _lowerings.CROSS_ENTROPY_OPS:
        _register(tx, op, _lowerings.cross_entropy(interop.call_jax), jax_function=False, needs_env=True)
    for op, (name, positions) in _lowerings.SAME_DTYPE.items():
        impl = tx._ops[op].func  # a JAX-level lowering (torchax's or one of the above)
        _register(tx, op, _lowerings.same_dtype_kind(name, positions, impl), jax_function=True, needs_env=False)


_AUTOCAST_DEVICES = ("cpu", "cuda")
# torch-level functions torchax lowers whole, so its aten-level autocast table never sees them
_AUTOCAST_LOWER = (
    torch.nn.functional.linear,
    torch.nn.functional.scaled_dot_product_attention,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.bmm,
    torch.mm,
)


def torch_autocast_dtype() -> torch.dtype | None:
    """The dtype of an enclosing ``torch.autocast`` region (any device type), or None outside one."""
    for device in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


def _honouring_torch_autocast(tx: Environment, dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` that applies torchax's autocast policy inside ``torch.autocast`` regions.

    torch's autocast lives in dispatch keys that torchax tensors never reach, so without this a
    ``torch.autocast`` block in user code would silently change nothing.
    """

    def autocast_dispatch(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        dtype = torch_autocast_dtype() if tx.param.autocast_dtype is None else None
        if dtype is None:
            return dispatch(func, types, args, kwargs)
        if func in _AUTOCAST_LOWER:
            with tx:
                args, kwargs = amp.execute_policy(amp.CastPolicy.LOWER_PRECISION_FP, args, kwargs or {}, dtype)
        with tx.override_property(autocast_dtype=dtype):
            return dispatch(func, types, args, kwargs)

    return autocast_dispatch


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


@contextlib.contextmanager
def tensors_not_meta() -> Iterator[None]:
    """Inside the block, torchax tensors report ``is_meta`` False (they hold values; their torch storage is meta).

    ``torch.nn.init.trunc_normal_``, ``sparse_`` and ``dirac_`` return early for meta tensors, so
    without this they silently do nothing while `init_sharded` builds a model. Only there: elsewhere
    torch may read ``is_meta`` to avoid touching storage.
    """
    tx, key = env(), torch.Tensor.is_meta.__get__  # type: ignore[attr-defined]
    previous = tx._ops.get(key)  # private: the env's op table, as in _register
    tx.override_op_definition(key, _init_ops.is_meta)
    try:
        yield
    finally:
        if previous is None:
            del tx._ops[key]
        else:
            tx._ops[key] = previous


class StackedArray:
    """An array whose leading dim stacks layers, read one layer at a time by `LayerView` s."""

    def __init__(self, array: jax.Array) -> None:
        self.array = array

    def replace(self, array: jax.Array) -> None:
        """Points every view at a new stacked array (after a training step)."""
        self.array = array

    def layer(self, index: int) -> jax.Array:
        """Layer ``index`` of the current array (a fresh slice: nothing is kept, so memory stays bounded)."""
        return self.array[index]


class LayerView(Tensor):
    """A torchax tensor that is one layer of a `StackedArray`, always the current one, sliced when read.

    A scanned Trainer keeps each layer's weights only in stacked arrays; its module's per-layer
    parameters are these views, so ``trainer.model`` reads the latest values without a copy per step.
    """

    @staticmethod
    def __new__(cls, stack: StackedArray, index: int, *, param: bool = False, requires_grad: bool = False):
        like = jax.ShapeDtypeStruct(stack.array.shape[1:], stack.array.dtype)
        return Tensor.__new__(cls, like, env(), requires_grad)

    def __init__(self, stack: StackedArray, index: int, *, param: bool = False, requires_grad: bool = False) -> None:
        # torchax's __init__ would store a concrete array; a view reads its stack instead
        self._stack, self._index, self._env = stack, index, env()
        if param:
            self._is_param = True  # what makes isinstance(view, torch.nn.Parameter) true, as for torchax params

    @property
    def _elem(self) -> jax.Array:  # private: torchax reads the wrapped array from this attribute
        return self._stack.layer(self._index)

    @_elem.setter
    def _elem(self, value: jax.Array) -> None:
        raise RuntimeError(
            "this tensor is one layer of a scanned Trainer's stacked weights and cannot be written in place; "
            "change the weights through a checkpoint (torchshard.load) or build the Trainer with scan_layers=False"
        )


@contextlib.contextmanager
def seeded(key: jax.Array) -> Iterator[None]:
    """Inside the block, torch random ops under torchax draw from ``key`` (a raw uint32 key)."""
    with env().override_property(prng=key):
        yield


def current_key() -> jax.Array:
    """The key torch random ops under torchax draw from next."""
    return env().param.prng


def continue_from(key: jax.Array) -> None:
    """Torch random ops draw from ``key`` next (inside a `seeded` block: the block still restores the old key)."""
    env().param.prng = key


def backend_started() -> bool:
    """Whether JAX has created its backends (after which the CPU device count is fixed)."""
    from jax._src import xla_bridge  # private: JAX has no public "is the backend up" query

    return bool(xla_bridge._backends)


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU torch tensor as numpy, in the dtype JAX will hold (64-bit narrowed unless x64 is on)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jax.numpy.bfloat16)
    arr = t.numpy()
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]
    if not x64 and arr.dtype.itemsize == 8 and arr.dtype.kind in "iuf":
        arr = arr.astype(arr.dtype.kind + "4")
    return arr


def jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The dtype JAX holds a torch tensor of ``dtype`` in (int64 → int32 unless x64 is on)."""
    held = np.dtype(mappings.t2j_dtype(dtype))
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]
    return np.dtype(held.kind + "4") if not x64 and held.itemsize == 8 and held.kind in "iuf" else held


def to_torch(host: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A numpy array (from a jax array) as a writable CPU torch tensor of ``dtype``."""
    if host.dtype.name == "bfloat16":
        return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16).to(dtype)
    return torch.from_numpy(np.array(host)).to(dtype)  # a copy: torch warns on read-only numpy
