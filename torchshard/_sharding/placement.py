"""The one place that moves tensors onto devices: parameters, buffers, batches and activations."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import raise_if_any
from torchshard._base.validate import (
    instance_problems,
    mismatch_problems,
    raise_for_arguments,
)
from torchshard._bridge.layer_view import LayerView
from torchshard._bridge.module_tensors import model_tensors, named_tensors, set_tensor
from torchshard._bridge.tensors import host_array, is_jax_tensor, jax_dtype, unwrap, wrap
from torchshard._sharding.plan import ShardingPlan


def put(value: Any, sharding: NamedSharding, *, process_local: bool = False, what: str = "a value") -> jax.Array:
    """Places ``value`` (CPU torch tensor, torchax tensor, numpy or jax array) with ``sharding``.

    Under tracing this is a sharding constraint; eagerly a transfer. Host data is read one
    addressable shard at a time, so each process only places its own shards. With
    ``process_local``, ``value`` is only this process's part of the global array (its rows of
    each sharded dim, concatenated in order), as when each host loads its own slice of a batch.
    ``what`` names the value in the `ShardingError` for 64-bit integers that 32 bits cannot hold.
    """
    value = unwrap(value)
    if isinstance(value, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(value, sharding)
    if process_local:
        return jax.make_array_from_process_local_data(sharding, _host(value, what))
    if isinstance(value, jax.Array):
        return jax.device_put(value, sharding)
    host = _host(value, what)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put_stacked(
    values: Sequence[Any], sharding: NamedSharding, *, dtype: Any = None, what: str = "a stack"
) -> jax.Array:
    """``values`` stacked on a new dim 0 and placed with ``sharding``, each device built from its own rows alone.

    Host values (CPU torch tensors, numpy) are never placed one by one: a device whose shard holds
    rows ``i..j`` of the stack (a pipeline stage's layers) receives those values and no others, so
    no device ever holds another stage's layers. Placed values are stacked by a jitted call.
    ``dtype`` casts host values (a `MixedPrecision` master copy).
    """
    whole = _viewed_stack(values)
    arrays = [unwrap(v) for v in values] if whole is None else []
    if whole is not None or all(isinstance(a, jax.Array) for a in arrays):
        shape = (len(values), *values[0].shape)
        stack = whole if whole is not None else stack_placed(list(enumerate(arrays)), shape, sharding)
        if stack is None:  # layers not on their rows' devices (placed elsewhere): stacked and moved by XLA
            stack = jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*arrays)
        stack = jax.device_put(stack, sharding)  # a no-op where it already lies so
        return stack if dtype is None or stack.dtype == dtype else stack.astype(dtype)
    hosts = [_host(a, f"{what}[{i}]") for i, a in enumerate(arrays)]

    def rows(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is not None  # a NamedSharding gives every device its slices
        part = np.stack([hosts[i][index[1:]] for i in range(len(hosts))[index[0]]])
        return part if dtype is None else part.astype(dtype, copy=False)

    return jax.make_array_from_callback((len(hosts), *hosts[0].shape), sharding, rows)


def _viewed_stack(values: Sequence[Any]) -> jax.Array | None:
    """The stacked array ``values`` are the layers of, in order (as `init_sharded` with a pipeline builds them)."""
    stacks = {id(v._stack) for v in values if isinstance(v, LayerView)}
    if len(stacks) != 1 or [getattr(v, "_index", None) for v in values] != list(range(len(values))):
        return None
    array = values[0]._stack.array
    return array if array.shape[0] == len(values) else None


def row_sharding(sharding: NamedSharding, rows: int, row: int, *, block: bool = False) -> NamedSharding:
    """Where row ``row`` of a ``rows``-row stack placed with ``sharding`` lives: the devices holding it alone.

    Its other dims keep their spec; a dim 0 split over mesh axes (a pipeline's stages) becomes the
    sub-mesh of the devices at that row's position on those axes. With ``block``, the sharding of
    that position's whole block of rows (dim 0 kept, unsplit).

    Examples:
        >>> mesh = ts.make_mesh({"stage": 4, "data": 2})
        >>> one = row_sharding(NamedSharding(mesh, P("stage", "data")), 8, 5)
        >>> one.spec, [d.id for d in one.mesh.devices.flat]
        (P('data',), [4, 5])
    """
    spec = tuple(sharding.spec) + (None,) * (1 - len(sharding.spec))
    rest = (None,) if block else ()
    axes = () if spec[0] is None else (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    mesh = sharding.mesh
    assert isinstance(mesh, Mesh)
    sizes = [mesh.shape[a] for a in axes]
    position = np.unravel_index(row // (rows // math.prod(sizes)), sizes) if axes else ()
    where: list[Any] = [slice(None)] * mesh.devices.ndim
    for axis, at in zip(axes, position, strict=True):
        where[mesh.axis_names.index(axis)] = int(at)
    kept = [i for i, name in enumerate(mesh.axis_names) if name not in axes]
    sub = Mesh(
        mesh.devices[tuple(where)],
        tuple(mesh.axis_names[i] for i in kept),
        axis_types=tuple(mesh.axis_types[i] for i in kept),
    )
    return NamedSharding(sub, PartitionSpec(*rest, *spec[1:]))


def _bounds(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def stack_placed(
    parts: Sequence[tuple[int, jax.Array]], shape: Sequence[int], sharding: NamedSharding
) -> jax.Array | None:
    """The ``shape`` stack of ``parts`` built on each device from what it already holds; None where one lacks it.

    ``parts`` are (first row, array): one layer (rank one less than ``shape``) or a block of rows.
    A device's shard of the stack is its rows' shards, which must lie on it with the same slices
    of the other dims; nothing moves between devices, so a device holding only its pipeline
    stage's layers never receives another's.
    """
    shape = tuple(shape)
    shards: list[jax.Array] = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        assert index is not None  # a NamedSharding gives every device its slices
        low, high = index[0].indices(shape[0])[:2]
        found = [
            _piece(start, array, device, index[1:], shape[1:], low, high)
            for start, array in parts
            if start < high and start + (len(array) if array.ndim == len(shape) else 1) > low
        ]
        pieces = [p for p in found if p is not None]
        if not pieces or len(pieces) < len(found):
            return None
        shards.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _piece(
    start: int, array: jax.Array, device: Any, rest: tuple[slice, ...], shape: Sequence[int], low: int, high: int
) -> jax.Array | None:
    """This device's shard of ``array`` (rows from ``start``) cut to rows ``low..high``, or None if it lacks one."""
    layer = array.ndim == len(shape)
    wanted = _bounds(rest, shape)
    for shard in array.addressable_shards:
        if shard.device != device or shard.index is None:
            continue
        got = _bounds(shard.index, array.shape)
        if layer and got == wanted:
            return shard.data[None]
        if not layer and got[1:] == wanted and got[0] == (0, len(array)):
            cut = (max(low - start, 0), min(high - start, len(array)))
            return shard.data if cut == (0, len(array)) else shard.data[cut[0] : cut[1]]
    return None


def _host(value: Any, what: str) -> np.ndarray:
    raise_if_any(range_problems(what, value), header="64-bit integers that 32 bits cannot hold")
    return host_array(value) if isinstance(value, torch.Tensor) else np.asarray(value)


_NARROWED: dict[Any, type[np.integer]] = {torch.int64: np.int32, torch.uint64: np.uint32}
_NARROWED |= {np.dtype(np.int64): np.int32, np.dtype(np.uint64): np.uint32}


def range_problems(name: str, value: Any) -> list[str]:
    """A 64-bit integer host value with values outside the 32 bits JAX holds it in (``jax_enable_x64`` off).

    JAX would silently wrap them; this names the value and the two fixes.

    Examples:
        >>> print(*range_problems("step", torch.tensor([2**40])))
        step (1,) torch.int64: values in [1099511627776, 1099511627776] do not fit int32, which JAX holds it in ...
    """
    narrow = _NARROWED.get(getattr(value, "dtype", None))
    x64 = jax.config.jax_enable_x64
    if narrow is None or x64 or getattr(value, "device", None) == torch.device("meta"):
        return []
    if not isinstance(value, torch.Tensor | np.ndarray) or math.prod(value.shape) == 0:
        return []
    low, high, limits = int(value.min()), int(value.max()), np.iinfo(narrow)
    if limits.min <= low and high <= limits.max:
        return []
    return [
        f"{name} {tuple(value.shape)} {value.dtype}: values in [{low}, {high}] do not fit {np.dtype(narrow)}, which "
        f"JAX holds it in unless 64-bit mode is on; keep the values within [{limits.min}, {limits.max}], or call "
        f"jax.config.update('jax_enable_x64', True) first thing in the program"
    ]


def assign(model: torch.nn.Module, arrays: Mapping[str, jax.Array], plan: ShardingPlan) -> torch.nn.Module:
    """Rebinds every name of ``plan`` in ``model`` to the torchax tensor of its canonical array."""
    tensors = {t.name: t for t in model_tensors(model)}
    made: dict[str, torch.Tensor] = {}
    for name, entry in plan.entries.items():
        canon = plan.canonical(name)
        if canon not in arrays:
            continue
        if canon not in made:
            like = tensors[canon].tensor
            array = arrays[canon]
            made[canon] = torch.nn.Parameter(wrap(array), like.requires_grad) if entry.kind == "param" else wrap(array)
        set_tensor(model, name, made[canon], param=entry.kind == "param")
    return model


def match_problems(model: torch.nn.Module, plan: ShardingPlan) -> list[str]:
    """Every way ``plan`` does not fit ``model``: names, shapes, dtypes, and tensors with no values."""
    tensors = named_tensors(model)
    planned = {n: e.shape for n, e in plan.entries.items()}
    problems = mismatch_problems(
        planned, {n: tuple(t.shape) for n, t in tensors.items()}, expected_in="plan", found_in="model"
    )
    for name, t in tensors.items():
        entry = plan.entries.get(name)
        if entry is not None and not _same_dtype(t, entry.dtype):
            problems.append(f"{name}: model dtype {t.dtype} but plan dtype {entry.dtype} (the model changed dtype)")
        if t.device.type == "meta":
            problems.append(f"{name} {tuple(t.shape)}: on the meta device (no values); use init_sharded()")
    return problems


def _same_dtype(tensor: torch.Tensor, planned: torch.dtype) -> bool:
    """Whether ``tensor`` holds the plan's dtype; a placed one holds it as JAX does (int64 as int32 unless x64)."""
    # shard() narrows 64-bit tensors, so a Trainer built on a sharded module sees int32 where the plan says int64
    if is_jax_tensor(tensor):
        return jax_dtype(tensor.dtype) == jax_dtype(planned)
    return tensor.dtype == planned


def shard(model: torch.nn.Module, plan: ShardingPlan, *, skip: Collection[str] = ()) -> torch.nn.Module:
    """Places every parameter and buffer of ``model`` as the plan says, in place; ties stay tied.

    Args:
        model: module with CPU (or already placed torchax) tensors.
        plan: from `plan` on this model.
        skip: names left where they are (a Trainer places a pipeline's layers stage by stage itself).

    Returns:
        ``model``, whose tensors are now torchax tensors backed by sharded ``jax.Array`` s.

    Raises:
        ArgumentError: ``model`` is not a module or ``plan`` not a `ShardingPlan`.
        ShardingError: the plan does not fit the model (every missing, extra, mis-shaped,
            re-typed or meta tensor), or an int64 tensor holds values 32 bits cannot
            (``jax_enable_x64`` off); nothing is moved.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> model = shard(model, ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=1024)))
        >>> model[0].weight.jax().sharding.spec
        P('data', None)
    """
    check_model_and_plan(model, plan, doing="shard()")
    tensors = named_tensors(model)
    entries = plan.unique_entries()
    problems = [p for e in entries for p in range_problems(e.name, tensors[e.name])]
    raise_if_any(problems, header=f"shard(): {type(model).__name__} holds values JAX cannot; nothing was moved")
    arrays = {e.name: put(tensors[e.name], e.sharding, what=e.name) for e in entries if e.name not in skip}
    return assign(model, arrays, plan)


def check_model_and_plan(model: Any, plan: Any, *, doing: str) -> None:
    """Raises if ``model`` is not a module, ``plan`` not a plan, or the plan does not fit the model."""
    problems = instance_problems("model", model, torch.nn.Module, "a torch.nn.Module")
    problems += instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    raise_for_arguments(problems, header=f"invalid {doing} arguments")
    header = f"plan does not fit {type(model).__name__}; re-run plan() on this model after changing it"
    raise_if_any(match_problems(model, plan), header=header)
