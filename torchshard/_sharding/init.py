"""init_sharded: build a module with every tensor created directly in its shards."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._base.validate import instance_problems, int_problems, mismatch_problems, raise_for_arguments
from torchshard._bridge.env import env, seeded, tensors_not_meta
from torchshard._bridge.init_calls import failed_init, traceable_inits
from torchshard._bridge.init_views import aliasing, materialised
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import is_jax_tensor, unwrap
from torchshard._sharding.placement import row_sharding, stack_placed
from torchshard._sharding.plan import PlanEntry, ShardingPlan, plan
from torchshard._sharding.rules import Rules, as_rules

Select = Callable[[dict[str, torch.Tensor]], list[jax.Array]]


def _materialise(
    model_fn: Callable[[], torch.nn.Module], p: ShardingPlan, seed: int, select: Select, shardings: list[Any]
) -> list[jax.Array]:
    """``select`` of ``model_fn()``'s tensors, built by one jitted call with ``shardings`` as its outputs' (XLA
    computes only what those outputs need, each where it lives)."""
    tx = env()

    def build(key: jax.Array) -> list[jax.Array]:
        # torch init consumes torchax's RNG: seed it for this trace only, so its tracers stay inside;
        # aliasing: writes through views (w[0].zero_(), eye_, padding rows) reach their tensors, as in torch
        with seeded(jax.random.PRNGKey(key)), tensors_not_meta(), traceable_inits(), tx, aliasing(tx):
            return select(_build(model_fn, p))

    try:
        return jax.jit(build, out_shardings=shardings)(np.uint32(seed))
    except Exception as e:  # an init op torchax cannot run: name it, keep its traceback
        failure = _build_failure(e, p.unique_entries())
        if failure is e:
            raise
        raise failure from e


def materialise(
    model_fn: Callable[[], torch.nn.Module],
    p: ShardingPlan,
    seed: int,
    stacks: Mapping[str, tuple[Sequence[str], NamedSharding]] | None = None,
) -> dict[str, jax.Array]:
    """Every canonical tensor of ``p`` built directly sharded; the layers of each of ``stacks`` (key → its layers'
    names and the stack's sharding) built as one stacked array instead.

    A stack split over mesh axes (a pipeline's stages) is built by one call per block of rows, on the
    devices holding that block alone, so no device ever computes or holds another block's layers.
    Each call runs the same ``model_fn`` under the same seed, so the values are those of one build.
    """
    stacks = stacks or {}
    stacked = {n for names, _ in stacks.values() for n in names}
    names = [e.name for e in p.unique_entries() if e.name not in stacked]
    arrays = dict(
        zip(
            names,
            _materialise(model_fn, p, seed, lambda t: [unwrap(t[n]) for n in names], [p[n] for n in names]),
            strict=True,
        )
    )
    blocks = [
        (key, start, layers[start:stop], block)
        for key, (layers, sharding) in stacks.items()
        for start, stop, block in _blocks(sharding, (len(layers), *p.entries[layers[0]].shape))
    ]
    by_mesh: dict[Any, list[Any]] = {}
    for job in blocks:
        by_mesh.setdefault(job[3].mesh, []).append(job)
    built: dict[str, list[tuple[int, jax.Array]]] = {}
    for jobs in by_mesh.values():

        def select(t: dict[str, torch.Tensor], jobs: list[Any] = jobs) -> list[jax.Array]:
            return [jnp.stack([unwrap(t[n]) for n in layers]) for _, _, layers, _ in jobs]

        for (key, start, _, _), array in zip(
            jobs, _materialise(model_fn, p, seed, select, [j[3] for j in jobs]), strict=True
        ):
            built.setdefault(key, []).append((start, array))
    for key, (layers, sharding) in stacks.items():
        shape = (len(layers), *p.entries[layers[0]].shape)
        whole = stack_placed(built[key], shape, sharding)
        assert whole is not None  # each block was built on exactly its rows' devices
        arrays[key] = whole
    return arrays


def _blocks(sharding: NamedSharding, shape: tuple[int, ...]) -> list[tuple[int, int, NamedSharding]]:
    """The blocks of rows one set of devices holds, as (first row, end, the block's sharding on those devices)."""
    found: dict[tuple[int, int], NamedSharding] = {}
    for index in sharding.devices_indices_map(shape).values():
        start, stop = index[0].indices(shape[0])[:2]
        found.setdefault((start, stop), row_sharding(sharding, shape[0], start, block=True))
    return [(start, stop, block) for (start, stop), block in sorted(found.items())]


def _build(model_fn: Callable[[], torch.nn.Module], p: ShardingPlan) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        # 64-bit tensors are narrowed unless x64 is on, as `shard` does; JAX would warn per tensor
        warnings.filterwarnings("ignore", "Explicitly requested dtype int64", UserWarning)
        with torch.device("jax"):
            model = model_fn()
        return _checked_rebuild(model, p)


def _build_failure(error: Exception, entries: list[PlanEntry]) -> ShardingError:
    init = failed_init(error)
    if isinstance(error, ShardingError):
        return ShardingError(f"{init}: {error}") if init else error
    if init is not None:  # torch's init ran an op torchax cannot run, or branched on traced values
        first = (str(error).strip().splitlines() or [""])[0]
        return ShardingError(
            f"{init} cannot run while init_sharded builds the model ({type(error).__name__}: {first:.300}); "
            f"build the model on CPU and place it with shard(model, plan), or use another init for that tensor"
        )
    if isinstance(error, OverflowError):
        wide = [x.name for x in entries if x.dtype in (torch.int64, torch.uint64)]
        return ShardingError(
            f"model_fn() creates a 64-bit integer that does not fit the 32 bits JAX holds it in ({error}); 64-bit "
            f"tensors: {wide}; keep their values within int32, or call jax.config.update('jax_enable_x64', True) "
            f"first thing in the program"
        )
    first = (str(error).strip().splitlines() or [""])[0]
    return ShardingError(
        f"model_fn() failed while building under torchax, directly sharded ({type(error).__name__}: {first:.300}); "
        f"it built on meta, so an init op has no working torchax lowering or branches on tensor values (which "
        f"are traced here): build the model on CPU and place it with shard(model, plan), or replace that init"
    )


def _checked_rebuild(model: Any, p: ShardingPlan) -> dict[str, torch.Tensor]:
    """The tensors of the traced build, which must be the meta build's, each a torchax tensor."""
    tensors = named_tensors(model) if isinstance(model, torch.nn.Module) else {}
    tensors = {n: materialised(t) for n, t in tensors.items()}  # a view model_fn kept: its values, as its own
    expected = {n: e.shape for n, e in p.entries.items()}
    found = {n: tuple(t.shape) for n, t in tensors.items()}
    problems = mismatch_problems(expected, found, expected_in="first (meta) build", found_in="second build")
    problems += [f"{n}: a plain tensor on {t.device}" for n, t in tensors.items() if not is_jax_tensor(t)]
    header = "model_fn() built a different model the second time; make every call build the same modules and shapes"
    raise_if_any(problems, header=header)
    return tensors


def _model_fn_problems(model_fn: Any) -> list[str]:
    if isinstance(model_fn, torch.nn.Module):
        return [
            f"model_fn is a built {type(model_fn).__name__}; pass a function that builds it "
            f"(e.g. lambda: {type(model_fn).__name__}(...)), or place a built model with shard(model, plan)"
        ]
    if not callable(model_fn):
        return [f"model_fn must be a callable that builds the model, got {type(model_fn).__name__} {model_fn!r:.60}"]
    try:
        inspect.signature(model_fn).bind()
    except TypeError as e:
        return [f"model_fn must build the model with no arguments ({e}); wrap it, e.g. lambda: model_fn(config)"]
    except ValueError:  # no signature to inspect (some builtins): calling it will tell
        pass
    return []


def _check_args(model_fn: Any, mesh: Any, default: Any, seed: Any) -> None:
    problems = _model_fn_problems(model_fn)
    problems += instance_problems(
        "mesh", mesh, Mesh, "a jax Mesh of devices, e.g. make_mesh({'data': 8}) (values need real devices)"
    )
    if default not in ("replicate", "error"):
        problems.append(f"default={default!r} must be 'replicate' or 'error'")
    problems += int_problems("seed", seed, minimum=0, none="torch.initial_seed()")
    raise_for_arguments(problems, header="invalid init_sharded() arguments")


def _build_on_meta(model_fn: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception as e:  # the user's code: say where it ran, keep its traceback
        raise ShardingError(
            f"model_fn() raised {type(e).__name__} while building the model on the meta device (no values): {e}; "
            f"make it build under torch.device('meta') (no .item() or data-dependent shapes), or build the model "
            f"yourself and place it with shard(model, plan)"
        ) from e
    problems = instance_problems("model_fn()", model, torch.nn.Module, "a torch.nn.Module (model_fn builds the model)")
    raise_for_arguments(problems + _placed_problems(model), header="invalid init_sharded() arguments")
    return model


def _placed_problems(model: Any) -> list[str]:
    """Tensors model_fn put on a device itself, which init_sharded could not create sharded."""
    if not isinstance(model, torch.nn.Module):
        return []
    by_device: dict[str, list[str]] = {}
    for name, t in named_tensors(model).items():
        if t.device.type != "meta":
            by_device.setdefault(str(t.device), []).append(name)
    return [
        f"model_fn() creates {len(names)} tensor(s) on {device} itself ({', '.join(names[:5])}"
        f"{', ...' if len(names) > 5 else ''}); drop the device= arguments so init_sharded can create them sharded"
        for device, names in by_device.items()
    ]


def planned(
    model_fn: Callable[[], torch.nn.Module],
    mesh: Mesh,
    rules: Rules | Iterable[Any] | None,
    *,
    default: Literal["replicate", "error"],
    seed: int | None,
) -> tuple[torch.nn.Module, ShardingPlan, int]:
    """`init_sharded`'s arguments checked, ``model_fn()`` built on meta and planned, and the seed to build with."""
    _check_args(model_fn, mesh, default, seed)
    rules = as_rules(rules)  # a malformed table fails before model_fn runs
    model = _build_on_meta(model_fn)
    p = plan(model, mesh, rules, default=default)
    return model, p, torch.initial_seed() % 2**32 if seed is None else seed
