"""Torch-facing ``shard_map``: a torch function mapped over the shards of its inputs, one call per device."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._base.specs import parse_spec
from torchshard._base.validate import axis_problems, describe_mesh, spec_problems
from torchshard._bridge.env import continue_from, current_key, env, seeded
from torchshard._bridge.tensors import jax_view, torch_view
from torchshard._sharding.placement import put

Specs = PartitionSpec | Sequence[Any] | None


def _spec(spec: Any, what: str) -> PartitionSpec:
    made = parse_spec(spec)
    if made is None:
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
    return [p for i, s in enumerate(specs) for p in axis_problems(f"{what}[{i}] {s} on {describe_mesh(mesh)}", s, mesh)]


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _as_tuple(specs: tuple[PartitionSpec, ...] | PartitionSpec, count: int) -> tuple[PartitionSpec, ...]:
    return specs if isinstance(specs, tuple) else (specs,) * count


def _check_inputs(args: Sequence[Any], specs: tuple[PartitionSpec, ...], mesh: Mesh) -> None:
    problems = []
    for i, (arg, spec) in enumerate(zip(args, specs, strict=True)):
        if not isinstance(arg, torch.Tensor | jax.Array):
            problems.append(f"argument {i} is a {type(arg).__name__}; shard_map takes torch tensors")
            continue
        problems += spec_problems(f"argument {i}", tuple(arg.shape), spec, mesh)
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

    Examples:
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

    def body(key: jax.Array, *arrays: jax.Array) -> Any:
        # torch random ops inside draw from torchax's key: this call's, in and out as an array, so
        # no traced key is left behind in the environment and the next call draws fresh numbers
        with env(), torch.device("jax"), seeded(key):
            out = fn(*torch_view(arrays))
            _check_outputs(out, out_tree, mesh)
            return jax_view(out), current_key()

    compiled: dict[tuple[PartitionSpec, ...], Callable[..., Any]] = {}

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        specs = _as_tuple(_per_item(in_tree, len(args), "in_specs"), len(args))
        _check_inputs(args, specs, mesh)
        if specs not in compiled:
            mapped = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(PartitionSpec(), *specs),
                out_specs=(out_tree, PartitionSpec()),
                check_vma=check_vma,
            )
            # the outputs keep exactly the out_specs' shardings (a tuple of outputs alone would drop trailing Nones)
            shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_tree, is_leaf=_is_spec)
            compiled[specs] = jax.jit(mapped, out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())))
        arrays = [put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
        out, key = compiled[specs](current_key(), *arrays)
        continue_from(key)
        return torch_view(out)

    return call
