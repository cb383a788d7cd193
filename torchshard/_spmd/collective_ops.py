"""The ``jax.lax`` collectives on torch tensors, and per-device random keys, for use inside ``shard_map``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import torch

from torchshard._base.errors import ShardingError
from torchshard._bridge.env import seeded
from torchshard._bridge.tensors import is_jax_tensor, torch_view, unwrap, wrap

AxisName = str | tuple[str, ...]


def _jax_value(x: Any, op: str) -> Any:
    def one(leaf: Any) -> Any:
        if is_jax_tensor(leaf):
            return unwrap(leaf)
        if isinstance(leaf, torch.Tensor):
            raise ShardingError(
                f"{op}() got a plain {leaf.device.type} torch tensor of shape {tuple(leaf.shape)}; collectives "
                f"work on the tensors torchshard.collectives.shard_map passes to your function"
            )
        return leaf

    return jax.tree.map(one, x, is_leaf=lambda leaf: isinstance(leaf, torch.Tensor))


def _collective(op: Callable[..., Any], axis_name: AxisName, *operands: Any, **kwargs: Any) -> Any:
    """Runs ``jax.lax`` collective ``op`` on torch values; unbound axis names become a `ShardingError`."""
    values = [_jax_value(x, op.__name__) for x in operands]
    try:
        out = op(*values, axis_name, **kwargs)
    except NameError as err:
        axes = list(jax.sharding.get_abstract_mesh().shape)
        where = f"the enclosing shard_map's mesh axes are {axes}" if axes else "it was called outside shard_map"
        raise ShardingError(
            f"{op.__name__}(axis_name={axis_name!r}): unknown axis, {where}; call it inside "
            f"torchshard.collectives.shard_map with an axis of its mesh"
        ) from err
    return torch_view(out)


def all_gather(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> torch.Tensor:
    """Gathers ``x`` from every device along ``axis_name`` (``jax.lax.all_gather``).

    Args:
        x: the local block.
        axis_name: mesh axis (or tuple of axes) to gather over.
        axis: where the gathered blocks go.
        tiled: concatenate along ``axis`` instead of stacking a new dim.

    Returns:
        The gathered tensor, the same on every device of the axis.

    Examples:
        >>> w_full = all_gather(w_block, "data", axis=0, tiled=True)  # doctest: +SKIP
    """
    return _collective(jax.lax.all_gather, axis_name, x, axis=axis, tiled=tiled)


def psum(x: Any, axis_name: AxisName) -> Any:
    """Sums ``x`` (a tensor or a tuple/dict of them) over ``axis_name`` (``jax.lax.psum``).

    Examples:
        >>> total = psum(partial_sum, "model")  # doctest: +SKIP
    """
    return _collective(jax.lax.psum, axis_name, x)


def pmean(x: Any, axis_name: AxisName) -> Any:
    """Averages ``x`` over ``axis_name`` (``jax.lax.pmean``).

    Examples:
        >>> mean = pmean(x.mean(dim=1, keepdim=True), "model")  # doctest: +SKIP
    """
    return _collective(jax.lax.pmean, axis_name, x)


def psum_scatter(
    x: torch.Tensor, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False
) -> torch.Tensor:
    """Sums ``x`` over ``axis_name`` and leaves each device one block of the sum (reduce-scatter).

    Args:
        x: the local partial result.
        axis_name: mesh axis to reduce over.
        scatter_dimension: the dim split between devices.
        tiled: keep the split dim (size / n) instead of removing it (size must then equal n).

    Examples:
        >>> y_block = psum_scatter(h @ w2_block, "model", scatter_dimension=1, tiled=True)  # doctest: +SKIP
    """
    return _collective(jax.lax.psum_scatter, axis_name, x, scatter_dimension=scatter_dimension, tiled=tiled)


def all_to_all(
    x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False
) -> torch.Tensor:
    """Splits ``x`` along ``split_axis``, sends block i to device i, concatenates along ``concat_axis``.

    Examples:
        >>> cols = all_to_all(rows, "data", split_axis=1, concat_axis=0, tiled=True)  # doctest: +SKIP
    """
    return _collective(jax.lax.all_to_all, axis_name, x, split_axis=split_axis, concat_axis=concat_axis, tiled=tiled)


def ppermute(x: Any, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """Sends ``x`` from device ``src`` to device ``dst`` for each ``(src, dst)`` in ``perm``.

    Devices that receive nothing get zeros.

    Examples:
        >>> n = mesh.shape["data"]  # doctest: +SKIP
        >>> shifted = ppermute(x, "data", [(i, (i + 1) % n) for i in range(n)])  # doctest: +SKIP
    """
    return _collective(jax.lax.ppermute, axis_name, x, perm=[tuple(p) for p in perm])


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """This device's index along ``axis_name`` (a scalar int32 tensor; tuples give the flat index).

    Examples:
        >>> i = axis_index("data")  # doctest: +SKIP
    """
    return _collective(jax.lax.axis_index, axis_name)


def axis_size(axis_name: AxisName) -> int:
    """The number of devices along ``axis_name`` (a Python int).

    Examples:
        >>> n = axis_size("data")  # doctest: +SKIP
    """
    return _collective(jax.lax.axis_size, axis_name)


def _base_key(seed: int | torch.Generator | torch.Tensor | jax.Array) -> jax.Array:
    if isinstance(seed, torch.Generator):
        seed = seed.initial_seed()
    if isinstance(seed, int) and not isinstance(seed, bool):
        return jax.random.PRNGKey(seed % 2**63)
    key = unwrap(seed)
    if isinstance(key, jax.Array) and key.shape == (2,) and key.dtype == jax.numpy.uint32:
        return key
    raise ShardingError(
        f"fold_rng(seed_or_generator={seed!r}): give an int seed, a torch.Generator, or a key from fold_rng "
        f"(a uint32 tensor of shape (2,))"
    )


def fold_rng(seed_or_generator: int | torch.Generator | torch.Tensor, axis: AxisName) -> torch.Tensor:
    """A random key that differs between devices along ``axis`` and is reproducible from the seed.

    The device's index along ``axis`` is folded into the key of ``seed_or_generator``
    (``jax.random.fold_in(PRNGKey(seed), axis_index(axis))``), so devices along ``axis`` draw
    different numbers while devices along other axes (e.g. tensor-parallel peers, which must
    agree) draw the same ones. Fold again to split over more axes. Draw torch random numbers
    from the key with `use_rng`.

    Args:
        seed_or_generator: an int seed, a ``torch.Generator`` (its ``initial_seed()``), or a key
            returned by ``fold_rng``.
        axis: the mesh axis (or tuple of axes, folded as one flat index).

    Returns:
        The per-device key: a uint32 torch tensor of shape (2,), a raw JAX PRNG key.

    Raises:
        ShardingError: called outside `shard_map`, an unknown axis, or an unusable seed.

    Examples:
        >>> def noisy(x):
        ...     with use_rng(fold_rng(0, "data")):
        ...         return x + torch.randn(x.shape)  # different noise on each data shard
    """
    key = _base_key(seed_or_generator)
    index = axis_index(axis)
    return wrap(jax.random.fold_in(key, unwrap(index)))


@contextlib.contextmanager
def use_rng(key: torch.Tensor) -> Iterator[None]:
    """Inside the block, torch random ops (``torch.randn``, dropout, ...) draw from ``key``.

    Args:
        key: from `fold_rng` (a uint32 tensor of shape (2,)).

    Examples:
        >>> with use_rng(fold_rng(seed, "data")):  # doctest: +SKIP
        ...     mask = torch.rand(x.shape) > 0.1
    """
    with seeded(_base_key(key)):
        yield
