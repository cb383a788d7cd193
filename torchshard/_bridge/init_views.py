"""Torch's aliasing while `init_sharded` builds under torchax: writes through views, ``out=`` and ``copy_``.

torchax (0.0.13, and unchanged in the 0.0.14 nightlies) models one kind of view: ``t[basic index]``
returns a ``torchax.view.View`` that writes back to its source, and only the ops registered as view
ops (``copy_``, the ``add_``/``mul_`` family) write through it. Every other in-place op (``fill_``,
``zero_``, ``normal_``, ``uniform_``...) writes a fresh copy of the view; every other view op
(``select``, ``narrow``, ``view``, ``t``, ``unbind``, ``diagonal``, ``.flatten()``...) returns a fresh
array; ``torch.eye(n, m, out=t)`` ignores ``out``. A write through any of them is silently lost:
``nn.init.eye_``, ``w[0].zero_()``, an embedding's padding row. `aliasing` wraps the environment's
dispatch so that, while the model builds, every view op returns an `AliasView` of its source and
every op that writes a tensor (by its ATen schema) writes through views, as torch does.
"""

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
import torch.utils._pytree as pytree

from torchshard._base.errors import ShardingError
from torchshard._bridge.loaded import (
    TENSOR_CONSTRUCTORS,
    OperatorNotFound,
    Tensor,
    View,
    ViewInfo,
    ViewInfoType,
    mappings,
)

aten = torch.ops.aten

# view ops (by schema) that are not views of a torchax tensor here: torchax moves or copies through them
_NOT_VIEWS = {aten.lift_fresh.default, aten.pin_memory.default}


# --- how a view reads from and writes into its parent's array ---------------------------------------


class _Index(ViewInfo):
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


def _meta(value: torch.Tensor) -> torch.Tensor:
    """How torch lays ``value`` out over its storage, as a meta tensor."""
    if isinstance(value, AliasView):
        return value.like
    with _plain_torch():  # torch's own size and strides of the tensor (t_() transposes them, say)
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")


@contextlib.contextmanager
def _plain_torch() -> Iterator[None]:
    """Inside the block torch runs its own kernels: no torchax modes, no default-device mode."""
    with mode_utils.no_dispatch(), torch._C.DisableTorchFunction():
        yield


def _is_ours(value: Any) -> bool:
    return isinstance(value, Tensor | View)


# --- view ops -----------------------------------------------------------------------------------------


def _is_view_op(func: Any) -> bool:
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
        return _Index(_along(a["dim"], ndim, a["index"]))
    if func is aten.slice.Tensor:
        return _Index(_along(a["dim"], ndim, slice(a["start"], a["end"], a["step"])))
    if func is aten.narrow.default:
        return _Index(_along(a["dim"], ndim, slice(a["start"], a["start"] + a["length"])))
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
        return [_Index(_along(dim, len(shape), i)) for i in range(len(outs))]
    if func.overloadpacket in (aten.split, aten.split_with_sizes):
        starts = np.cumsum([0] + [o.shape[dim] for o in outs])
        return [_Index(_along(dim, len(shape), slice(int(s), int(e)))) for s, e in itertools.pairwise(starts)]
    return []


def _gather(func: Any, args: Sequence[Any], kwargs: dict[str, Any], parent: torch.Tensor) -> list[ViewInfo]:
    """Infos that read each output by the flat positions torch's own op picks from the parent."""
    name = str(func)
    if func is aten.as_strided.default and not (_meta(parent).is_contiguous() and not _meta(parent).storage_offset()):
        return []  # as_strided addresses storage, which is the parent's positions only for a whole contiguous parent
    with _plain_torch():
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
    with _plain_torch():
        like = func(_meta(parent), *args[1:], **kwargs)
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


def _views(dispatch: Callable[..., Any], func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    infos, like = view_infos(dispatch, func, args, kwargs)
    parent, env = args[0], args[0]._env
    if isinstance(like, list | tuple):
        return [AliasView(parent, info, env, like=m) for info, m in zip(infos, like, strict=True)]
    return AliasView(parent, infos[0], env, like=like)


def getitem(env: Any, dispatch: Callable[..., Any], tensor: torch.Tensor, index: Any) -> torch.Tensor:
    """``tensor[index]``: a view for a basic index, as in torch; a copy otherwise (advanced indexing)."""
    if _basic(index):
        with _plain_torch():
            like = _meta(tensor)[index]
        return AliasView(tensor, _Index(index), env, like=like)
    return dispatch(torch.Tensor.__getitem__, (), (materialised(tensor), index), {})


def _basic(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(p, int | slice | type(None) | type(Ellipsis)) and not isinstance(p, bool) for p in parts)


# --- writes -------------------------------------------------------------------------------------------


def _written(func: Any) -> list[tuple[int, str, bool]]:
    """(position, name, keyword-only) of each argument the op writes, by its schema."""
    return [
        (i, a.name, a.kwarg_only)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def write(target: torch.Tensor, value: Any) -> None:
    """Writes ``value`` (broadcast, cast) into ``target`` in place: a torchax tensor or a view of one."""
    held = target.source_jax().dtype if isinstance(target, View) else target._elem.dtype  # type: ignore[attr-defined]
    array = value.jax() if _is_ours(value) else jnp.asarray(value)
    array = jnp.broadcast_to(array.astype(held), tuple(target.shape))
    if isinstance(target, View):
        target.update(array)
    else:
        target._elem = array  # type: ignore[attr-defined]  # private: torchax has no public setter


def _write_op(dispatch: Callable[..., Any], func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Runs an op that writes some of its arguments so that writes into views reach their sources."""
    args, kwargs = list(args), dict(kwargs)
    staged: list[tuple[Any, Any]] = []  # (what the op should write, what it writes: a torchax tensor)
    unwritten: list[tuple[Any, Any]] = []  # out= tensors, with the array they held
    for i, name, kwarg_only in _written(func):
        in_args = i < len(args) and not kwarg_only
        target = args[i] if in_args else kwargs.get(name)
        if not _is_ours(target):
            continue
        stand_in = materialised(target)
        staged.append((target, stand_in))
        if kwarg_only:
            unwritten.append((stand_in, stand_in._elem))
        if in_args:
            args[i] = stand_in
        else:
            kwargs[name] = stand_in
    result = _dispatch_or_functional(dispatch, func, types, tuple(args), kwargs)
    if len(unwritten) == 1 and unwritten[0][0]._elem is unwritten[0][1] and result is not unwritten[0][0]:
        write(unwritten[0][0], result)  # torchax ran the functional op and dropped out=; write its result
    for target, stand_in in staged:
        if target is not stand_in:
            write(target, stand_in)
    swap = {id(s): t for t, s in staged}
    return pytree.tree_map_only(torch.Tensor, lambda r: swap.get(id(r), r), result)


def _dispatch_or_functional(dispatch: Callable[..., Any], func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    """Runs ``func``; an in-place op torchax lacks (``log_``, ``erfinv_``...) as its functional op, written back."""
    try:
        return dispatch(func, types, args, kwargs)
    except OperatorNotFound:
        functional = _functional(func) if func.overloadpacket.__name__.endswith("_") else None
        if functional is None or [w[0] for w in _written(func)] != [0]:
            raise
    return copy_(args[0], dispatch(functional, types, args, kwargs))


def _functional(func: Any) -> Any:
    """The functional op of an in-place one (``t_`` → ``t``, ``transpose_`` → ``transpose.int``), or None."""
    packet = getattr(aten, func.overloadpacket.__name__.removesuffix("_"), None)
    names = [a.name for a in func._schema.arguments]
    overloads = map(packet.__getattr__, packet.overloads()) if packet is not None else ()
    return next((op for op in overloads if [a.name for a in op._schema.arguments] == names), None)


def _inplace_view(dispatch: Callable[..., Any], func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``t_``, ``squeeze_``, ``unsqueeze_``...: the tensor itself becomes the view, its layout torch's."""
    target = args[0]
    infos, like = view_infos(dispatch, _functional(func), args, kwargs)
    if isinstance(target, AliasView):  # the view of its source becomes a view of that view
        target.parent = AliasView(target.parent, target.view_info, target._env, like=target.like)
        target.view_info, target.like = infos[0], like
    else:
        target._elem = infos[0].transform_tensor(target._elem)
    with _plain_torch():  # torch's metadata change, on the wrapper tensor (it holds no data)
        func(target, *args[1:], **kwargs)
    return target


def copy_(target: torch.Tensor, source: Any, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy_``: torch's broadcasting and casting, into a tensor or a view, from any tensor or view."""
    if isinstance(source, torch.Tensor) and not _is_ours(source):  # a CPU tensor: moved, as torch would
        env = target._env  # type: ignore[attr-defined]
        source = Tensor(env.t2j_copy(source), env)
    write(target, source)
    return target


def _out_of_constructor(dispatch: Callable[..., Any], func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``torch.eye(n, m, out=t)`` and the like: torchax's constructors ignore ``out``."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out")
    result = dispatch(func, types, args, kwargs)
    if tuple(result.shape) != tuple(out.shape):
        raise ShardingError(
            f"model_fn() calls {getattr(func, '__name__', func)}(..., out=) with out of shape {tuple(out.shape)} "
            f"for a result of shape {tuple(result.shape)}; torch would resize out, init_sharded cannot: pass an "
            f"out of the result's shape"
        )
    write(out, result)
    return out


# --- the dispatch --------------------------------------------------------------------------------------


def aliasing_dispatch(env: Any, dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` with torch's view semantics: views alias their source and writes through them land there."""

    def dispatch_with_views(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            return getitem(env, dispatch, args[0], args[1])
        if func in TENSOR_CONSTRUCTORS and _is_ours(kwargs.get("out")):
            return _out_of_constructor(dispatch, func, types, args, kwargs)
        if not isinstance(func, torch._ops.OpOverload):
            return dispatch(func, types, args, kwargs)
        if func is aten.copy_.default and _is_ours(args[0]):
            return copy_(*args, **kwargs)
        if func not in _NOT_VIEWS and args and _is_ours(args[0]) and _is_view_op(func):
            return _views(dispatch, func, args, kwargs)
        if torch.Tag.inplace_view in func.tags and _is_ours(args[0]):
            return _inplace_view(dispatch, func, args, kwargs)
        if func._schema.is_mutable:
            return _write_op(dispatch, func, types, args, kwargs)
        return dispatch(func, types, args, kwargs)

    return dispatch_with_views


@contextlib.contextmanager
def aliasing(env: Any) -> Iterator[None]:
    """Inside the block, ``env`` gives torchax tensors torch's view semantics (see the module docstring).

    Example:
        >>> from torchshard._bridge.env import env
        >>> tx = env()
        >>> with tx, aliasing(tx):
        ...     w = torch.ones(2, 3, device="jax")
        ...     _ = w[0].zero_(), w.t()[2].fill_(5)
        ...     values = w.jax().tolist()
        >>> values
        [[0.0, 0.0, 5.0], [1.0, 1.0, 5.0]]
    """
    previous = env.dispatch
    flatten = Tensor.__dict__["flatten"]
    env.dispatch = aliasing_dispatch(env, previous)
    del Tensor.flatten  # torchax's own returns a copy; torch's (a view where it can be) goes through dispatch
    try:
        yield
    finally:
        env.dispatch = previous
        Tensor.flatten = flatten
