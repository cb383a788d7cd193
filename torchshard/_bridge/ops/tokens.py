"""How lowerings that flatten a batch's [rows, sequence] tokens into one dim keep them sharded while traced.

Flattening ``[rows, seq, ...]`` into ``[rows·seq, ...]`` keeps a sharding of rows over one axis and
of the sequence over another only while each device holds one row: with more, a device's tokens are
not one contiguous run of the flat dim, and GSPMD gathers the sequence first. A context-parallel
step sets a `TokenLayout` for the trace: `flatten` then orders tokens sequence-chunk-major (so the
flat dim stays sharded, for lowerings that undo it themselves), and `constrain_flat` pins a flat
dim that is reduced order-free (a loss) to the rows' and sequence's axes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._bridge.vmapped import vmapped_axes


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """The sequence (dim 1) split in ``chunks`` over ``mesh``; rows over ``row_axes``, chunks over ``seq_axis``."""

    chunks: int
    mesh: Mesh | None = None
    row_axes: tuple[str, ...] = ()
    seq_axis: str | None = None


_LAYOUT: contextvars.ContextVar[TokenLayout | None] = contextvars.ContextVar("token_layout", default=None)
_PLAIN = TokenLayout(1)  # outside a layout: flatten in order, constrain nothing


def _layout() -> TokenLayout:
    return _LAYOUT.get() or _PLAIN


@contextlib.contextmanager
def laid_out(layout: TokenLayout) -> Iterator[None]:
    """Inside the block, token-flattening lowerings follow ``layout``."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def _row_axes(layout: TokenLayout) -> tuple[str, ...]:
    """The layout's row axes a constraint may name here: not those a pipeline's ``vmap`` traces over.

    Inside a pipeline whose stages also split rows over data shards, the rows are vmapped over those
    axes (``spmd_axis_name``), which a sharding constraint in the body may not mention: the rows here
    are one shard's already.
    """
    vmapped = vmapped_axes()
    return tuple(axis for axis in layout.row_axes if axis not in vmapped)


def _chunked(shape: tuple[int, ...]) -> int:
    chunks = _layout().chunks
    return chunks if chunks > 1 and len(shape) >= 3 and shape[1] % chunks == 0 else 1


def flatten(x: jax.Array) -> jax.Array:
    """``[d0, d1, ..., k]`` → ``[tokens, k]``; under a layout, ``d1``'s chunks major (undo with `unflatten`).

    Examples:
        >>> flatten(jnp.arange(6).reshape(1, 3, 2)).shape
        (3, 2)
    """
    chunks = _chunked(x.shape)
    if chunks > 1:
        x = _pinned(x.reshape(x.shape[0], chunks, x.shape[1] // chunks, *x.shape[2:]), rows=0, chunks=1)
        x = _pinned(jnp.moveaxis(x, 1, 0), rows=1, chunks=0)
    return x.reshape(-1, x.shape[-1])


def unflatten(out: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of `flatten` for an ``[tokens, n]`` result of a ``shape`` input: ``[*shape[:-1], n]``."""
    chunks = _chunked(shape)
    if chunks == 1:
        return out.reshape(*shape[:-1], out.shape[-1])
    out = _pinned(out.reshape(chunks, shape[0], shape[1] // chunks, *shape[2:-1], out.shape[-1]), rows=1, chunks=0)
    return _pinned(jnp.moveaxis(out, 0, 1), rows=0, chunks=1).reshape(*shape[:-1], out.shape[-1])


def _pinned(x: jax.Array, *, rows: int, chunks: int) -> jax.Array:
    """``x`` with its ``rows`` dim over the layout's row axes and its ``chunks`` dim over its sequence axis.

    Each constraint is its own transpose, so the gradient is pinned the same way. Without them, a
    loss that flattens the logits rows-major (transformers' ``view(-1, vocab)``) handed the chunk-major
    backward a gradient GSPMD could only reorder by gathering it whole: Llama-3-8B's [128, 8192, 128256]
    logits on every device under ``data=16, context=4``.
    """
    layout = _layout()
    if layout.mesh is None or layout.seq_axis is None:
        return x
    spec: list[object] = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[chunks] = layout.seq_axis
    row_axes = _row_axes(layout)
    size = 1
    for axis in row_axes:
        size *= layout.mesh.shape[axis]
    if row_axes and x.shape[rows] % size == 0:
        spec[rows] = row_axes
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, PartitionSpec(*spec)))


def constrain_flat(x: jax.Array) -> jax.Array:
    """``x``'s dim 0 (flat tokens) sharded over the rows' and the sequence's axes under a layout, else ``x``.

    For a flat dim consumed order-free (a mean over tokens): GSPMD then moves each device's tokens
    with one all-to-all instead of gathering every sequence.
    """
    layout = _layout()
    if layout.mesh is None or layout.seq_axis is None or x.ndim == 0:
        return x
    axes = (*_row_axes(layout), layout.seq_axis)
    size = 1
    for axis in axes:
        size *= layout.mesh.shape[axis]
    if x.shape[0] % size:
        return x
    spec = PartitionSpec(axes, *[PartitionSpec.UNCONSTRAINED] * (x.ndim - 1))
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))
