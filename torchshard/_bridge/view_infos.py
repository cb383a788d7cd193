"""How a view reads from and writes into its parent's array: the view kinds `init_views` builds for each view op."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._mode_utils as mode_utils

from torchshard._base.errors import ShardingError
from torchshard._bridge.loaded import (
    Tensor,
    View,
    ViewInfo,
    ViewInfoType,
    mappings,
)

aten = torch.ops.aten

# view ops (by schema) that are not views of a torchax tensor here: torchax moves or copies through them
NOT_VIEWS = {aten.lift_fresh.default, aten.pin_memory.default}


# --- how a view reads from and writes into its parent's array ---------------------------------------


class Index(ViewInfo):
    """``parent[index]`` for a basic index (ints, slices, None, Ellipsis): select, slice, narrow, split."""

    def __init__(self, index: Any) -> None:
        super().__init__(ViewInfoType.NARROW)
        self.index = index

    def transform_tensor(self, jax_array: jax.Array) -> jax.Array:
        return jax_array[self.index]

    def update_tensor(self, new_value: jax.Array, jax_array: jax.Array) -> jax.Array:
        return jax_array.at[self.index].set(new_value.astype(jax_array.dtype))

    def calculate_output_shape(self, source: jax.Array) -> list[int]:
        return list(jax.eval_shape(self.transform_tensor, source).shape)


class _Reshape(ViewInfo):
    """The parent's elements in another shape: view, unsqueeze, squeeze, flatten, an expand that expands nothing."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__(ViewInfoType.RESHAPE)
        self.shape = tuple(shape)

    def transform_tensor(self, jax_array: jax.Array) -> jax.Array:
        return jax_array.reshape(self.shape)

    def update_tensor(self, new_value: jax.Array, jax_array: jax.Array) -> jax.Array:
        return jnp.broadcast_to(new_value, self.shape).reshape(jax_array.shape).astype(jax_array.dtype)

    def calculate_output_shape(self, source: jax.Array) -> list[int]:
        return list(self.shape)


class _Permute(ViewInfo):
    """The parent's dims reordered: t, transpose, permute."""

    def __init__(self, dims: Sequence[int]) -> None:
        super().__init__(ViewInfoType.PERMUTE)
        self.dims = tuple(dims)

    def transform_tensor(self, jax_array: jax.Array) -> jax.Array:
        return jnp.transpose(jax_array, self.dims)

    def update_tensor(self, new_value: jax.Array, jax_array: jax.Array) -> jax.Array:
        shape = [jax_array.shape[d] for d in self.dims]
        new_value = jnp.broadcast_to(new_value, shape).astype(jax_array.dtype)
        return jnp.transpose(new_value, [int(d) for d in np.argsort(self.dims)])

    def calculate_output_shape(self, source: jax.Array) -> list[int]:
        return [source.shape[d] for d in self.dims]


class _Gather(ViewInfo):
    """Any other view whose elements are the parent's (diagonal, unfold, expand...), by their flat positions.

    The positions are a constant as large as the view, so only views that are not the bulk of a tensor
    (the structured infos above cover those) come here.
    """

    def __init__(self, positions: np.ndarray, op: str) -> None:
        super().__init__(ViewInfoType.AS_STRIDED)
        self.positions, self.op = positions, op

    def transform_tensor(self, jax_array: jax.Array) -> jax.Array:
        return jax_array.reshape(-1)[self.positions]

    def update_tensor(self, new_value: jax.Array, jax_array: jax.Array) -> jax.Array:
        if len(np.unique(self.positions)) != self.positions.size:  # torch refuses such writes too
            raise ShardingError(
                f"model_fn() writes into the result of {self.op}, where several elements are one element of the "
                f"tensor it views; write into the tensor itself"
            )
        flat = jax_array.reshape(-1).at[self.positions.reshape(-1)]
        new_value = jnp.broadcast_to(new_value, self.positions.shape).astype(jax_array.dtype)
        return flat.set(new_value.reshape(-1)).reshape(jax_array.shape)

    def calculate_output_shape(self, source: jax.Array) -> list[int]:
        return list(self.positions.shape)


class _ReadOnly(ViewInfo):
    """A view torchshard reads (through torchax's lowering of ``op``) but cannot write back into its source."""

    def __init__(self, read: Callable[[jax.Array], jax.Array], op: str, shape: Sequence[int]) -> None:
        super().__init__(ViewInfoType.INVALID)
        self.read, self.op, self.shape = read, op, list(shape)

    def transform_tensor(self, jax_array: jax.Array) -> jax.Array:
        return self.read(jax_array)

    def update_tensor(self, new_value: jax.Array, jax_array: jax.Array) -> jax.Array:
        raise ShardingError(
            f"model_fn() writes into the result of {self.op}, a view init_sharded cannot write back into the "
            f"tensor it views; write into that tensor directly, or build the model on CPU and place it with "
            f"shard(model, plan)"
        )

    def calculate_output_shape(self, source: jax.Array) -> list[int]:
        return self.shape


# --- the view tensor ----------------------------------------------------------------------------------


class AliasView(View):
    """A torchax `View` with torch's strides, so torch decides view-or-copy (``reshape``, ``contiguous``) as for CPU.

    ``like`` is a meta tensor laid out as torch lays the view out over its source's storage.
    """

    @staticmethod
    def __new__(cls, parent: torch.Tensor, view_info: ViewInfo, env: Any, *, like: torch.Tensor) -> AliasView:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            like.shape,
            strides=like.stride(),
            storage_offset=like.storage_offset(),
            dtype=like.dtype,
            device=torch.device("meta"),
            requires_grad=False,
        )

    def __init__(self, parent: torch.Tensor, view_info: ViewInfo, env: Any, *, like: torch.Tensor) -> None:
        super().__init__(parent, view_info, env)
        self.like = like

    def __setitem__(self, index: Any, value: Any) -> None:
        # torchax's Tensor.__setitem__ handles every index and value kind; run it on the view's values
        values = self.torch()
        values[index] = value
        self.update(values)


def is_view(value: Any) -> bool:
    """Whether ``value`` is a torchax view (torchax's own or an `AliasView`)."""
    return isinstance(value, View)


def materialised(value: Any) -> Any:
    """A view as a torchax tensor of its current values; anything else unchanged."""
    return value.torch() if isinstance(value, View) else value


def meta_of(value: torch.Tensor) -> torch.Tensor:
    """How torch lays ``value`` out over its storage, as a meta tensor."""
    if isinstance(value, AliasView):
        return value.like
    with plain_torch():  # torch's own size and strides of the tensor (t_() transposes them, say)
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")


@contextlib.contextmanager
def plain_torch() -> Iterator[None]:
    """Inside the block torch runs its own kernels: no torchax modes, no default-device mode."""
    with mode_utils.no_dispatch(), torch._C.DisableTorchFunction():
        yield


def is_ours(value: Any) -> bool:
    return isinstance(value, Tensor | View)


# --- view ops -----------------------------------------------------------------------------------------


def is_view_op(func: Any) -> bool:
    schema = func._schema
    returns = schema.returns
    return not schema.is_mutable and bool(returns) and all(r.alias_info is not None for r in returns)


def _bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _along(dim: int, ndim: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * _dim(dim, ndim) + (index,)


def _structured(func: Any, a: dict[str, Any], shape: tuple[int, ...], out: torch.Tensor) -> ViewInfo | None:
    """The structured info of the common view ops (no constants as large as the view), or None."""
    ndim = len(shape)
    if func in (aten.alias.default, aten.detach.default):
        return _Reshape(shape)
    if func is aten.select.int:
        return Index(_along(a["dim"], ndim, a["index"]))
    if func is aten.slice.Tensor:
        return Index(_along(a["dim"], ndim, slice(a["start"], a["end"], a["step"])))
    if func is aten.narrow.default:
        return Index(_along(a["dim"], ndim, slice(a["start"], a["start"] + a["length"])))
    if func is aten.t.default:
        return _Permute(tuple(reversed(range(ndim))))
    if func is aten.transpose.int:
        dims = list(range(ndim))
        d0, d1 = _dim(a["dim0"], ndim), _dim(a["dim1"], ndim)
        dims[d0], dims[d1] = d1, d0
        return _Permute(dims)
    if func is aten.permute.default:
        return _Permute([_dim(d, ndim) for d in a["dims"]])
    reshapes = (aten.view.default, aten._reshape_alias.default, aten.unsqueeze.default, aten.expand.default)
    # an expand that repeats elements is not a reshape (a _Gather)
    if (func in reshapes or func.overloadpacket is aten.squeeze) and out.numel() == math.prod(shape):
        return _Reshape(out.shape)
    return None


def _pieces(func: Any, a: dict[str, Any], shape: tuple[int, ...], outs: Sequence[torch.Tensor]) -> list[ViewInfo]:
    """The infos of the views a splitting op returns, or [] if it is not one."""
    dim = _dim(a.get("dim", 0), len(shape))
    if func is aten.unbind.int:
        return [Index(_along(dim, len(shape), i)) for i in range(len(outs))]
    if func.overloadpacket in (aten.split, aten.split_with_sizes):
        starts = np.cumsum([0] + [o.shape[dim] for o in outs])
        return [Index(_along(dim, len(shape), slice(int(s), int(e)))) for s, e in itertools.pairwise(starts)]
    return []


def _gather(func: Any, args: Sequence[Any], kwargs: dict[str, Any], parent: torch.Tensor) -> list[ViewInfo]:
    """Infos that read each output by the flat positions torch's own op picks from the parent."""
    name = str(func)
    if func is aten.as_strided.default and not (
        meta_of(parent).is_contiguous() and not meta_of(parent).storage_offset()
    ):
        return []  # as_strided addresses storage, which is the parent's positions only for a whole contiguous parent
    with plain_torch():
        positions = torch.arange(parent.numel(), dtype=torch.int64).reshape(tuple(parent.shape))
        picked = func(positions, *args[1:], **kwargs)
    picked = list(picked) if isinstance(picked, list | tuple) else [picked]
    if any(p.dtype != torch.int64 for p in picked):
        return []
    return [_Gather(p.numpy().astype(np.int32), name) for p in picked]


def view_infos(
    dispatch: Callable[..., Any], func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[list[ViewInfo], Any]:
    """How each output of view op ``func`` reads and writes its first argument, and torch's layout of the outputs."""
    parent = args[0]
    shape = tuple(parent.shape)
    with plain_torch():
        like = func(meta_of(parent), *args[1:], **kwargs)
    outs = list(like) if isinstance(like, list | tuple) else [like]
    bound = _bind(func, args, kwargs)
    if len(outs) == 1 and not isinstance(like, list | tuple):
        info = _structured(func, bound, shape, outs[0])
        if info is not None:
            return [info], like
    pieces = _pieces(func, bound, shape, outs)
    if pieces:
        return pieces, like
    same_dtype = all(o.dtype == parent.dtype for o in outs)
    gathered = _gather(func, args, kwargs, parent) if same_dtype else []
    return gathered or [_read_only(dispatch, func, args, kwargs, i, o.shape) for i, o in enumerate(outs)], like


def _read_only(
    dispatch: Callable[..., Any], func: Any, args: Sequence[Any], kwargs: dict[str, Any], i: int, shape: Sequence[int]
) -> ViewInfo:
    def read(array: jax.Array) -> jax.Array:  # torchax's own lowering of the op
        if func is aten.view.dtype:  # torchax lowers it as a reshape (to a dtype); it is a bitcast
            return jax.lax.bitcast_convert_type(array, mappings.t2j_dtype(args[1]))
        out = dispatch(func, (), (Tensor(array, args[0]._env), *args[1:]), kwargs)
        return (out[i] if isinstance(out, list | tuple) else out).jax()

    return _ReadOnly(read, str(func), shape)
