"""Tensors computed from constants alone (positions, masks, a model's own all-ones mask) computed while tracing."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import torch
from torch.utils import _pytree as torch_pytree

from torchshard._bridge.env import env
from torchshard._bridge.loaded import Tensor

_INDEX_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FILLS = (torch.ones, torch.zeros, torch.full)
# The most values a float fill is computed with while tracing: a [batch, seq] mask of a million tokens. Models also
# zero-fill activation-sized buffers they then write from the inputs (jetmoe, kimi_linear); computed now, such a
# buffer would be a constant of the whole program, held whole on every device where the sequence is split.
FILL_LIMIT = 2**20


def _constant(leaf: Any) -> bool:
    """A torchax tensor (or a view of one) holding a value, not a tracer."""
    if type(leaf) is Tensor:
        return not isinstance(leaf._elem, jax.core.Tracer)
    source = getattr(leaf, "source_jax", None)  # a torchax View reads its base without computing the view
    return source is not None and not isinstance(source(), jax.core.Tracer)


def _fill_size(args: Any, kwargs: Any) -> int | None:
    """How many values ``torch.ones/zeros/full(size, ...)`` makes, None where its size is not Python ints."""
    size = kwargs.get("size", args[0] if args else None)
    if isinstance(size, int):  # torch.ones(2, 3): the sizes are the positional ints
        size = args if all(isinstance(a, int) for a in args) else None
    if not isinstance(size, list | tuple | torch.Size) or not all(isinstance(n, int) for n in size):
        return None
    return math.prod(size)


def _folds(func: Any, args: Any, kwargs: Any) -> bool:
    """Every tensor input a constant (of any dtype), an integer/boolean factory, or a small float fill."""
    kwargs = kwargs or {}
    leaves = torch_pytree.tree_flatten((args, kwargs))[0]
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if tensors:
        return all(_constant(t) for t in tensors)
    if func is torch.arange:  # positions: arange of Python ints is int64
        return "dtype" not in kwargs and all(isinstance(a, int) for a in args)
    if kwargs.get("dtype") in _INDEX_DTYPES:
        return func not in (torch.randint, torch.randn, torch.rand)
    if func in _FILLS:  # BioGPT's torch.ones(batch, seq) attention_mask when the call passes none
        size = _fill_size(args, kwargs)
        return size is not None and size <= FILL_LIMIT
    return False


def _folding(dispatch: Callable[..., Any]) -> Callable[..., Any]:
    def fold_index_constants(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if not _folds(func, args, kwargs):
            return dispatch(func, types, args, kwargs)
        with jax.ensure_compile_time_eval(), _outside_manual_axes():
            return dispatch(func, types, args, kwargs)

    return fold_index_constants


def _outside_manual_axes() -> contextlib.AbstractContextManager[Any]:
    """Inside a ``shard_map`` body, an empty abstract mesh for the op computed now (else nothing changes).

    JAX computes an eager op there against the body's mesh, partly manual, and fails on its own
    sharding (``NotImplementedError: Unhandled OpSharding type ... last_tile_dims={manual,
    replicated}`` from ``jnp.arange(0, n, 1)``: transformers' experts build ``torch.arange(n)``
    inside the all-to-all dispatch's shard_map). The value is a per-device constant either way.
    """
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


@contextlib.contextmanager
def index_constants_folded() -> Iterator[None]:
    """Inside the block, torch ops on constant tensors run at trace time and give values.

    Under ``jit`` every op is staged, so ``torch.arange(S)`` is a tracer and code that inspects
    positions cannot: transformers then assumes packed sequences and builds a ``[B, 1, S, S]`` mask
    instead of passing ``is_causal=True``. So integer and boolean factories, float fills of at most
    `FILL_LIMIT` values (BioGPT's ``torch.ones(batch, seq)`` attention mask, which transformers reads
    as "no padding" only when it has values) and every op whose tensor inputs all have values run
    now. Anything touching the step's inputs or the model's tensors stays staged; so do JAX
    transformations (scan, checkpoint), which a global ``jax.ensure_compile_time_eval`` would break
    inside a ``shard_map``.
    """
    tx = env()
    dispatch = tx.dispatch
    tx.dispatch = _folding(dispatch)
    try:
        yield
    finally:
        tx.dispatch = dispatch
