"""constrain: an activation's sharding inside ``forward`` (a constraint under jit, a transfer through `put` eagerly)."""

from __future__ import annotations

import jax
import torch
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._base.specs import SpecLike, parse_spec
from torchshard._base.validate import describe_mesh, instance_problems, raise_for_arguments, spec_problems
from torchshard._bridge.tensors import is_jax_tensor, unwrap, wrap
from torchshard._sharding.placement import put


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
        ArgumentError: ``mesh`` is not a mesh.
        ShardingError: no mesh is known, or the spec does not fit the tensor.

    Examples:
        >>> h = torch.ones(8, 4)
        >>> constrain(h, ("data", None)) is h  # plain torch: unchanged, so forward still runs eagerly
        True
    """
    if mesh is not None:
        problems = instance_problems("mesh", mesh, (Mesh, AbstractMesh), "a jax Mesh, e.g. make_mesh({'data': 8})")
        raise_for_arguments(problems, header="invalid constrain() arguments")
    if not is_jax_tensor(tensor):
        return tensor
    where = _ambient_mesh(mesh, tracing=isinstance(unwrap(tensor), jax.core.Tracer))
    made = parse_spec(spec)
    if made is None:
        raise ShardingError(
            f"constrain(): spec {spec!r} for activation {tuple(tensor.shape)} on {describe_mesh(where)} is not a "
            f"PartitionSpec or a tuple of axis names / None; write e.g. ('data', None)"
        )
    raise_if_any(spec_problems("activation", tuple(tensor.shape), made, where), header="constrain()")
    return wrap(put(tensor, NamedSharding(where, made)))


def spec_of(tensor: torch.Tensor) -> PartitionSpec | None:
    """The ``PartitionSpec`` of a placed tensor (None if it is not a NamedSharding).

    Examples:
        >>> spec_of(torch.zeros(2)) is None
        True
    """
    sharding = unwrap(tensor).sharding if is_jax_tensor(tensor) else None
    return sharding.spec if isinstance(sharding, NamedSharding) else None
