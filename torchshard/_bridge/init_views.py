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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import torch
import torch.utils._pytree as pytree

from torchshard._base.errors import ShardingError
from torchshard._bridge.loaded import (
    TENSOR_CONSTRUCTORS,
    OperatorNotFound,
    Tensor,
    View,
)
from torchshard._bridge.view_infos import (
    NOT_VIEWS,
    AliasView,
    Index,
    is_ours,
    is_view_op,
    materialised,
    meta_of,
    plain_torch,
    view_infos,
)

aten = torch.ops.aten


def _views(dispatch: Callable[..., Any], func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    infos, like = view_infos(dispatch, func, args, kwargs)
    parent, env = args[0], args[0]._env
    if isinstance(like, list | tuple):
        return [AliasView(parent, info, env, like=m) for info, m in zip(infos, like, strict=True)]
    return AliasView(parent, infos[0], env, like=like)


def getitem(env: Any, dispatch: Callable[..., Any], tensor: torch.Tensor, index: Any) -> torch.Tensor:
    """``tensor[index]``: a view for a basic index, as in torch; a copy otherwise (advanced indexing)."""
    if _basic(index):
        with plain_torch():
            like = meta_of(tensor)[index]
        return AliasView(tensor, Index(index), env, like=like)
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
    array = value.jax() if is_ours(value) else jnp.asarray(value)
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
        if not is_ours(target):
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
    with plain_torch():  # torch's metadata change, on the wrapper tensor (it holds no data)
        func(target, *args[1:], **kwargs)
    return target


def copy_(target: torch.Tensor, source: Any, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy_``: torch's broadcasting and casting, into a tensor or a view, from any tensor or view."""
    if isinstance(source, torch.Tensor) and not is_ours(source):  # a CPU tensor: moved, as torch would
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
        if func in TENSOR_CONSTRUCTORS and is_ours(kwargs.get("out")):
            return _out_of_constructor(dispatch, func, types, args, kwargs)
        if not isinstance(func, torch._ops.OpOverload):
            return dispatch(func, types, args, kwargs)
        if func is aten.copy_.default and is_ours(args[0]):
            return copy_(*args, **kwargs)
        if func not in NOT_VIEWS and args and is_ours(args[0]) and is_view_op(func):
            return _views(dispatch, func, args, kwargs)
        if torch.Tag.inplace_view in func.tags and is_ours(args[0]):
            return _inplace_view(dispatch, func, args, kwargs)
        if func._schema.is_mutable:
            return _write_op(dispatch, func, types, args, kwargs)
        return dispatch(func, types, args, kwargs)

    return dispatch_with_views


@contextlib.contextmanager
def aliasing(env: Any) -> Iterator[None]:
    """Inside the block, ``env`` gives torchax tensors torch's view semantics (see the module docstring).

    Examples:
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
