"""The one place that moves tensors onto devices: placement, constraints and sharded init."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import jax
import numpy as np
import torch
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from torchshard import _compat
from torchshard._errors import ShardingError, raise_if_any
from torchshard._mesh import describe_mesh
from torchshard._plan import ShardingPlan, _spec_problems, model_tensors, named_tensors, plan
from torchshard._rules import Rules, SpecLike, TensorInfo, to_spec

_compat.import_torchax()
import torchax  # noqa: E402
import torchax.tensor  # noqa: E402

_fixed_envs: set[int] = set()


def env() -> torchax.tensor.Environment:
    """torchax's environment, created on first use (creating it starts the JAX backend)."""
    tx = torchax.default_env()
    if id(tx) not in _fixed_envs:
        _compat.fix_environment(tx)
        _fixed_envs.add(id(tx))
    return tx


def is_jax_tensor(t: Any) -> bool:
    return isinstance(t, torchax.tensor.Tensor)


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU torch tensor as numpy, in the dtype JAX will hold (64-bit narrowed unless x64 is on)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    arr = t.numpy()
    if not jax.config.jax_enable_x64 and arr.dtype.itemsize == 8 and arr.dtype.kind in "iuf":
        arr = arr.astype(arr.dtype.kind + "4")
    return arr


def put(value: Any, sharding: NamedSharding, *, process_local: bool = False) -> jax.Array:
    """Places ``value`` (CPU torch tensor, torchax tensor, numpy or jax array) with ``sharding``.

    Under tracing this is a sharding constraint; eagerly a transfer. Host data is read one
    addressable shard at a time, so each process only places its own shards. With
    ``process_local``, ``value`` is only this process's part of the global array (its rows of
    each sharded dim, concatenated in order), as when each host loads its own slice of a batch.
    """
    if is_jax_tensor(value):
        value = value.jax()
    if isinstance(value, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(value, sharding)
    if process_local:
        return jax.make_array_from_process_local_data(sharding, _host(value))
    if isinstance(value, jax.Array):
        return jax.device_put(value, sharding)
    host = _host(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _host(value: Any) -> np.ndarray:
    return host_array(value) if isinstance(value, torch.Tensor) else np.asarray(value)


def wrap(array: jax.Array) -> torch.Tensor:
    """A torchax tensor viewing ``array``."""
    return torchax.tensor.Tensor(array, env())


def _set(model: torch.nn.Module, name: str, value: torch.Tensor, kind: str) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if kind == "param":
        module._parameters[leaf] = value
    else:
        module._buffers[leaf] = value


def _as_param(array: jax.Array, like: torch.Tensor) -> torch.Tensor:
    return torch.nn.Parameter(wrap(array), requires_grad=like.requires_grad)


def assign(model: torch.nn.Module, arrays: dict[str, jax.Array], plan: ShardingPlan) -> torch.nn.Module:
    """Rebinds every name of ``plan`` in ``model`` to the torchax tensor of its canonical array."""
    tensors = {t.name: t for t in model_tensors(model)}
    made: dict[str, torch.Tensor] = {}
    for name, entry in plan.entries.items():
        canon = plan.canonical(name)
        if canon not in made:
            like = tensors[canon].tensor
            made[canon] = _as_param(arrays[canon], like) if entry.kind == "param" else wrap(arrays[canon])
        _set(model, name, made[canon], entry.kind)
    return model


def rebind(tensors: Mapping[str, torch.Tensor], arrays: Mapping[str, jax.Array]) -> None:
    """Points placed tensors at new arrays in place, so every holder (and tied alias) sees them."""
    for name, array in arrays.items():
        tensors[name]._elem = array


def _match_problems(model: torch.nn.Module, plan: ShardingPlan) -> list[str]:
    tensors = named_tensors(model)
    missing = [n for n in plan if n not in tensors]
    unexpected = [n for n in tensors if n not in plan]
    problems = [f"{n}: in the plan but not in the model" for n in missing]
    problems += [f"{n}: in the model but not in the plan; re-run plan() on this model" for n in unexpected]
    for name, t in tensors.items():
        entry = plan.entries.get(name)
        if entry is not None and tuple(t.shape) != entry.shape:
            problems.append(f"{name}: model shape {tuple(t.shape)} but plan shape {entry.shape}")
        if t.device.type == "meta":
            problems.append(f"{name} {tuple(t.shape)}: on the meta device (no values); use init_sharded()")
    return problems


def shard(model: torch.nn.Module, plan: ShardingPlan) -> torch.nn.Module:
    """Places every parameter and buffer of ``model`` as the plan says, in place; ties stay tied.

    Args:
        model: module with CPU (or already placed torchax) tensors.
        plan: from `plan` on this model.

    Returns:
        ``model``, whose tensors are now torchax tensors backed by sharded ``jax.Array`` s.

    Raises:
        ShardingError: the plan does not fit the model (every missing, extra, mis-shaped or meta tensor).

    Example:
        >>> model = shard(model, plan(model, mesh, presets.fsdp()))  # doctest: +SKIP
    """
    raise_if_any(_match_problems(model, plan), header=f"plan does not fit {type(model).__name__}")
    tensors = named_tensors(model)
    arrays = {e.name: put(tensors[e.name], e.sharding) for e in plan.unique_entries()}
    return assign(model, arrays, plan)


def batch_leaf_spec(leaf: Any, spec: PartitionSpec) -> PartitionSpec:
    """``spec`` for batch leaves of at least its rank; lower-rank leaves (scalars) are replicated."""
    return spec if len(getattr(leaf, "shape", ())) >= len(spec) else PartitionSpec()


def shard_batch(batch: Any, mesh: Mesh, spec: SpecLike = ("data",)) -> Any:
    """Places every tensor of ``batch`` on ``mesh`` (leading dim over ``"data"`` by default), for inference.

    Args:
        batch: a pytree (tensor, tuple, dict...) of CPU torch tensors, torchax tensors or arrays.
        mesh: the device mesh.
        spec: the spec of each leaf; leaves of lower rank are replicated.

    Returns:
        The same pytree of torchax tensors, ready for ``model(...)`` inside ``torchax.default_env()``.

    Raises:
        ShardingError: every leaf whose sharded dims do not divide by the mesh axes.

    Example:
        >>> x = shard_batch(torch.randn(64, 784), mesh)  # doctest: +SKIP
        >>> with torchax.default_env():  # doctest: +SKIP
        ...     logits = model(x)
    """
    spec = to_spec(spec)
    problems = []
    for i, leaf in enumerate(jax.tree.leaves(batch)):
        info = TensorInfo(f"batch leaf #{i}", tuple(leaf.shape), getattr(leaf, "dtype", None), None, mesh)
        problems += _spec_problems(info, batch_leaf_spec(leaf, spec))
    raise_if_any(problems, header=f"batch does not fit {spec} on {describe_mesh(mesh)}")
    return jax.tree.map(lambda x: wrap(put(x, NamedSharding(mesh, batch_leaf_spec(x, spec)))), batch)


def _ambient_mesh(mesh: Mesh | None, *, tracing: bool) -> Mesh | AbstractMesh:
    if mesh is not None:
        return mesh
    # under jit only the abstract mesh may be read (it is all with_sharding_constraint needs);
    # an eager transfer needs the concrete one
    found = jax.sharding.get_abstract_mesh() if tracing else jax.sharding.get_mesh()
    if found is None or not found.shape:
        raise ShardingError(
            "constrain() needs a mesh: pass mesh=, or call it inside Trainer.step / `with jax.set_mesh(mesh):`."
        )
    return found


def constrain(tensor: torch.Tensor, spec: SpecLike, mesh: Mesh | None = None) -> torch.Tensor:
    """Constrains an activation's sharding inside ``forward`` (a constraint under jit, a transfer eagerly).

    Args:
        tensor: a torchax tensor; a plain torch tensor is returned unchanged, so the same
            ``forward`` still runs in eager, unsharded torch.
        spec: ``PartitionSpec`` or tuple of axis names / None, e.g. ``("data", None)``.
        mesh: defaults to the mesh the Trainer traces under or ``jax.set_mesh``'s.

    Returns:
        The tensor with the requested sharding.

    Raises:
        ShardingError: no mesh is known, or the spec does not fit the tensor.

    Example:
        >>> h = constrain(h, ("data", None, "model"))  # doctest: +SKIP
    """
    if not is_jax_tensor(tensor):
        return tensor
    mesh = _ambient_mesh(mesh, tracing=isinstance(tensor.jax(), jax.core.Tracer))
    try:
        spec = to_spec(spec)
    except TypeError:
        raise ShardingError(
            f"constrain(): spec {spec!r} for activation {tuple(tensor.shape)} on {describe_mesh(mesh)} is not a "
            f"PartitionSpec or a tuple of axis names / None; write e.g. ('data', None)"
        ) from None
    info = TensorInfo("activation", tuple(tensor.shape), tensor.dtype, None, mesh)
    raise_if_any(_spec_problems(info, spec), header="constrain()")
    return wrap(put(tensor, NamedSharding(mesh, spec)))


def _materialise(model_fn: Callable[[], torch.nn.Module], p: ShardingPlan, seed: int) -> dict[str, jax.Array]:
    names = [e.name for e in p.unique_entries()]
    shardings = [p[n] for n in names]
    tx = env()

    def build(key: jax.Array) -> list[jax.Array]:
        # torch init consumes torchax's RNG: seed it for this trace only, so its tracers stay inside
        with tx.override_property(prng=jax.random.PRNGKey(key)), tx, warnings.catch_warnings():
            # 64-bit tensors are narrowed unless x64 is on, as `shard` does; JAX would warn per tensor
            warnings.filterwarnings("ignore", "Explicitly requested dtype int64", UserWarning)
            with torch.device("jax"):
                model = model_fn()
            tensors = named_tensors(model)
            return [tensors[n].jax() for n in names]

    arrays = jax.jit(build, out_shardings=shardings)(np.uint32(seed))
    return dict(zip(names, arrays, strict=True))


def init_sharded(
    model_fn: Callable[[], torch.nn.Module],
    mesh: Mesh,
    rules: Rules | Iterable[Any] | None = None,
    *,
    default: Literal["replicate", "error"] = "replicate",
    seed: int | None = None,
) -> torch.nn.Module:
    """Builds ``model_fn()`` with every tensor created directly sharded, never whole on one device.

    The model is first built on ``meta`` to plan it; then ``model_fn`` runs once inside a jitted
    function whose outputs are pinned to the plan, so XLA computes each shard where it lives.
    Deterministic inits (constants, ``ones``, ``arange``...) equal eager torch; random ones draw
    from JAX's RNG seeded by ``seed`` (default: ``torch.initial_seed()``).

    Args:
        model_fn: builds the module (no arguments); must not move tensors to a device itself.
        mesh: the device mesh.
        rules: as for `plan`.
        default: as for `plan`.
        seed: RNG seed for random initialisers.

    Returns:
        The module (built on meta) whose tensors are sharded torchax tensors.

    Example:
        >>> model = init_sharded(lambda: MLP(1024), mesh, presets.fsdp())  # doctest: +SKIP
    """
    with torch.device("meta"):
        model = model_fn()
    p = plan(model, mesh, rules, default=default)
    seed = torch.initial_seed() % 2**32 if seed is None else seed
    return assign(model, _materialise(model_fn, p, seed), p)


def sharding_summary(tensor: torch.Tensor) -> str:
    """``PartitionSpec`` and mesh of a placed tensor, for messages."""
    sharding = tensor.jax().sharding if is_jax_tensor(tensor) else None
    if isinstance(sharding, NamedSharding):
        return f"{sharding.spec} on {describe_mesh(sharding.mesh)}"
    return str(sharding)


def spec_of(tensor: torch.Tensor) -> PartitionSpec | None:
    """The ``PartitionSpec`` of a placed tensor (None if it is not a NamedSharding)."""
    sharding = tensor.jax().sharding if is_jax_tensor(tensor) else None
    return sharding.spec if isinstance(sharding, NamedSharding) else None
