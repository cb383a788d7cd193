"""Torch-facing ``shard_map`` and the ``jax.lax`` collectives, on torchax tensors."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard import _compat
from torchshard._errors import ShardingError, raise_if_any
from torchshard._mesh import describe_mesh
from torchshard._placement import env, is_jax_tensor, put, wrap
from torchshard._plan import _spec_problems
from torchshard._rules import TensorInfo, entry_axes, to_spec

_compat.import_torchax()
from torchax import interop  # noqa: E402

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "fold_rng",
    "pmean",
    "ppermute",
    "psum",
    "psum_scatter",
    "shard_map",
    "use_rng",
]

AxisName = str | tuple[str, ...]
Specs = PartitionSpec | Sequence[Any] | None


def _spec(spec: Any, what: str) -> PartitionSpec:
    try:
        made = to_spec(spec)
    except TypeError:
        made = None
    if not isinstance(made, PartitionSpec):
        raise ShardingError(
            f"{what} {spec!r} is not a PartitionSpec or a tuple of mesh-axis names / None; write e.g. P('data', None)"
        )
    return made


def _per_item(specs: Specs, count: int | None, what: str) -> tuple[PartitionSpec, ...] | PartitionSpec:
    """One spec for everything (a PartitionSpec, a name or None), or a tuple/list with one per item."""
    if specs is None or isinstance(specs, PartitionSpec | str):
        return _spec(specs, what)
    if not isinstance(specs, tuple | list):
        raise ShardingError(f"{what} {specs!r} must be a PartitionSpec or a tuple with one spec per item")
    if count is not None and len(specs) != count:
        raise ShardingError(
            f"{what} has {len(specs)} entries for {count} item(s); give one spec per item, "
            f"or one PartitionSpec for all (a single 2-D spec is P('data', None), not ('data', None))"
        )
    return tuple(_spec(s, f"{what}[{i}]") for i, s in enumerate(specs))


def _axis_problems(specs: Sequence[PartitionSpec], mesh: Mesh, what: str) -> list[str]:
    problems = []
    for i, spec in enumerate(specs):
        axes = [a for e in spec for a in entry_axes(e)]
        where = f"{what}[{i}] {spec} on {describe_mesh(mesh)}"
        problems += [
            f"{where}: unknown mesh axis {a!r}; use one of {list(mesh.shape)}" for a in axes if a not in mesh.shape
        ]
        problems += [f"{where}: mesh axis {a!r} is used twice" for a in sorted({a for a in axes if axes.count(a) > 1})]
    return problems


def _as_tuple(specs: tuple[PartitionSpec, ...] | PartitionSpec, count: int) -> tuple[PartitionSpec, ...]:
    return specs if isinstance(specs, tuple) else (specs,) * count


def _check_inputs(args: Sequence[Any], specs: tuple[PartitionSpec, ...], mesh: Mesh) -> None:
    problems = []
    for i, (arg, spec) in enumerate(zip(args, specs, strict=True)):
        if not isinstance(arg, torch.Tensor | jax.Array):
            problems.append(f"argument {i} is a {type(arg).__name__}; shard_map takes torch tensors")
            continue
        info = TensorInfo(f"argument {i}", tuple(arg.shape), None, None, mesh)
        problems += _spec_problems(info, spec)
    raise_if_any(problems, header=f"shard_map in_specs do not fit the arguments on {describe_mesh(mesh)}")


def _check_outputs(out: Any, specs: tuple[PartitionSpec, ...] | PartitionSpec, mesh: Mesh) -> None:
    if isinstance(specs, tuple) and (not isinstance(out, tuple | list) or len(out) != len(specs)):
        got = f"a {len(out)}-tuple" if isinstance(out, tuple | list) else f"one {type(out).__name__}"
        raise ShardingError(
            f"out_specs has {len(specs)} entries but the function returned {got}; return a tuple with one "
            f"tensor per spec, or pass one PartitionSpec"
        )
    leaves = list(out) if isinstance(specs, tuple) else jax.tree.leaves(out)
    problems = [
        f"output {i} has local shape {tuple(t.shape)} (rank {len(t.shape)}) but out_spec {spec} has {len(spec)} "
        f"entries; give at most {len(t.shape)}"
        for i, (t, spec) in enumerate(zip(leaves, _as_tuple(specs, len(leaves)), strict=True))
        if len(spec) > len(getattr(t, "shape", ()))
    ]
    raise_if_any(problems, header=f"shard_map out_specs do not fit the outputs on {describe_mesh(mesh)}")


def shard_map(
    fn: Callable[..., Any],
    *,
    mesh: Mesh,
    in_specs: Specs,
    out_specs: Specs,
    check_vma: bool = False,
) -> Callable[..., Any]:
    """Maps a torch function over the shards of its inputs, one call per device (``jax.shard_map`` for torch).

    Inside ``fn`` each argument is the device's local block (a torchax tensor), torch ops run
    locally, and the collectives of this module communicate across mesh axes. The result is
    jitted once per input signature, and differentiable under JAX transforms (e.g. inside a
    `Trainer` loss), though not by eager ``torch.autograd``.

    Args:
        fn: takes and returns torch tensors (a tensor or a tuple of them).
        mesh: a concrete device mesh (e.g. from `torchshard.make_mesh`).
        in_specs: one ``PartitionSpec`` for every argument, or a tuple with one spec per argument
            (each a ``PartitionSpec``, a tuple of axis names / None, a name, or None = replicated).
        out_specs: one ``PartitionSpec`` for the output(s), or a tuple with one per returned tensor.
        check_vma: let JAX check that outputs declared replicated really are (``jax.shard_map``'s flag).

    Returns:
        A function taking CPU torch tensors (placed per ``in_specs``) or torchax tensors (resharded
        if needed) and returning torchax tensors sharded per ``out_specs``.

    Raises:
        ShardingError: unknown or repeated mesh axes, a spec longer than its tensor, a dim not
            divisible by its axes, or spec counts that do not match the arguments or outputs.

    Example:
        >>> def matmul(x, w):  # w is split by rows over "data": gather it, FSDP style
        ...     return x @ all_gather(w, "data", axis=0, tiled=True)
        >>> rows = P("data", None)
        >>> f = shard_map(matmul, mesh=mesh, in_specs=(rows, rows), out_specs=rows)  # doctest: +SKIP
        >>> y = f(torch.randn(8, 16), torch.randn(16, 4))  # doctest: +SKIP
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(
            f"shard_map(mesh={mesh!r}) needs a concrete jax.sharding.Mesh with devices (an AbstractMesh "
            f"cannot run); build one with torchshard.make_mesh"
        )
    in_tree, out_tree = _per_item(in_specs, None, "in_specs"), _per_item(out_specs, None, "out_specs")
    flat = lambda s: s if isinstance(s, tuple) else (s,)  # noqa: E731
    raise_if_any(
        _axis_problems(flat(in_tree), mesh, "in_specs") + _axis_problems(flat(out_tree), mesh, "out_specs"),
        header="shard_map specs name bad mesh axes",
    )

    def body(*arrays: jax.Array) -> Any:
        with env(), torch.device("jax"):
            out = fn(*interop.torch_view(arrays))
            _check_outputs(out, out_tree, mesh)
            return interop.jax_view(out)

    compiled: dict[tuple[PartitionSpec, ...], Callable[..., Any]] = {}

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        specs = _as_tuple(_per_item(in_tree, len(args), "in_specs"), len(args))
        _check_inputs(args, specs, mesh)
        if specs not in compiled:
            mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_tree, check_vma=check_vma)
            compiled[specs] = jax.jit(mapped)
        arrays = [put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
        return interop.torch_view(compiled[specs](*arrays))

    return call


def _jax_value(x: Any, op: str) -> Any:
    def one(leaf: Any) -> Any:
        if is_jax_tensor(leaf):
            return leaf.jax()
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
    return interop.torch_view(out)


def all_gather(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> torch.Tensor:
    """Gathers ``x`` from every device along ``axis_name`` (``jax.lax.all_gather``).

    Args:
        x: the local block.
        axis_name: mesh axis (or tuple of axes) to gather over.
        axis: where the gathered blocks go.
        tiled: concatenate along ``axis`` instead of stacking a new dim.

    Returns:
        The gathered tensor, the same on every device of the axis.

    Example:
        >>> w_full = all_gather(w_block, "data", axis=0, tiled=True)  # doctest: +SKIP
    """
    return _collective(jax.lax.all_gather, axis_name, x, axis=axis, tiled=tiled)


def psum(x: Any, axis_name: AxisName) -> Any:
    """Sums ``x`` (a tensor or a tuple/dict of them) over ``axis_name`` (``jax.lax.psum``).

    Example:
        >>> total = psum(partial_sum, "model")  # doctest: +SKIP
    """
    return _collective(jax.lax.psum, axis_name, x)


def pmean(x: Any, axis_name: AxisName) -> Any:
    """Averages ``x`` over ``axis_name`` (``jax.lax.pmean``).

    Example:
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

    Example:
        >>> y_block = psum_scatter(h @ w2_block, "model", scatter_dimension=1, tiled=True)  # doctest: +SKIP
    """
    return _collective(jax.lax.psum_scatter, axis_name, x, scatter_dimension=scatter_dimension, tiled=tiled)


def all_to_all(
    x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False
) -> torch.Tensor:
    """Splits ``x`` along ``split_axis``, sends block i to device i, concatenates along ``concat_axis``.

    Example:
        >>> cols = all_to_all(rows, "data", split_axis=1, concat_axis=0, tiled=True)  # doctest: +SKIP
    """
    return _collective(jax.lax.all_to_all, axis_name, x, split_axis=split_axis, concat_axis=concat_axis, tiled=tiled)


def ppermute(x: Any, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """Sends ``x`` from device ``src`` to device ``dst`` for each ``(src, dst)`` in ``perm``.

    Devices that receive nothing get zeros.

    Example:
        >>> n = mesh.shape["data"]  # doctest: +SKIP
        >>> shifted = ppermute(x, "data", [(i, (i + 1) % n) for i in range(n)])  # doctest: +SKIP
    """
    return _collective(jax.lax.ppermute, axis_name, x, perm=[tuple(p) for p in perm])


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """This device's index along ``axis_name`` (a scalar int32 tensor; tuples give the flat index).

    Example:
        >>> i = axis_index("data")  # doctest: +SKIP
    """
    return _collective(jax.lax.axis_index, axis_name)


def axis_size(axis_name: AxisName) -> int:
    """The number of devices along ``axis_name`` (a Python int).

    Example:
        >>> n = axis_size("data")  # doctest: +SKIP
    """
    return _collective(jax.lax.axis_size, axis_name)


def _base_key(seed: int | torch.Generator | torch.Tensor | jax.Array) -> jax.Array:
    if isinstance(seed, torch.Generator):
        seed = seed.initial_seed()
    if isinstance(seed, int) and not isinstance(seed, bool):
        return jax.random.PRNGKey(seed % 2**63)
    key = seed.jax() if is_jax_tensor(seed) else seed
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

    Example:
        >>> def noisy(x):
        ...     with use_rng(fold_rng(0, "data")):
        ...         return x + torch.randn(x.shape)  # different noise on each data shard
    """
    key = _base_key(seed_or_generator)
    index = axis_index(axis)
    return wrap(jax.random.fold_in(key, index.jax()))


@contextlib.contextmanager
def use_rng(key: torch.Tensor) -> Iterator[None]:
    """Inside the block, torch random ops (``torch.randn``, dropout, ...) draw from ``key``.

    Args:
        key: from `fold_rng` (a uint32 tensor of shape (2,)).

    Example:
        >>> with use_rng(fold_rng(seed, "data")):  # doctest: +SKIP
        ...     mask = torch.rand(x.shape) > 0.1
    """
    with env().override_property(prng=_base_key(key)):
        yield
