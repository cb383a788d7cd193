"""shard_batch: a batch's tensors placed on the mesh (through `put`), leading dim over the batch axes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import raise_if_any
from torchshard._base.specs import SPEC_HINT, SpecLike, parse_spec
from torchshard._base.validate import describe_mesh, instance_problems, raise_for_arguments, spec_problems
from torchshard._bridge.tensors import wrap
from torchshard._sharding.placement import put, range_problems


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
        ArgumentError: ``spec`` is not a spec, ``mesh`` not a mesh, or a leaf is not an array
            with values (a str, a Python number, a meta tensor).
        ShardingError: every leaf whose sharded dims do not divide by the mesh axes, or whose
            int64 values 32 bits cannot hold.

    Examples:
        >>> mesh = ts.make_mesh({"data": 8})
        >>> model = ts.shard(torch.nn.Linear(16, 4), ts.plan(torch.nn.Linear(16, 4), mesh))
        >>> x = shard_batch(torch.randn(64, 16), mesh)
        >>> import torchax
        >>> with torchax.default_env():
        ...     logits = model(x)
        >>> logits.shape, logits.jax().sharding.spec
        (torch.Size([64, 4]), P('data',))
    """
    problems = instance_problems("mesh", mesh, Mesh, "a jax Mesh, e.g. make_mesh({'data': 8})")
    made = parse_spec(spec)
    problems += [] if made is not None else [f"spec={spec!r} is not {SPEC_HINT}"]
    leaves = jax.tree.leaves(batch)
    problems += [p for i, leaf in enumerate(leaves) for p in leaf_problems(f"batch leaf #{i}", leaf)]
    raise_for_arguments(problems, header="invalid shard_batch() arguments")
    assert made is not None
    problems = [
        p
        for i, leaf in enumerate(leaves)
        for p in spec_problems(f"batch leaf #{i}", leaf.shape, batch_leaf_spec(leaf, made), mesh)
    ]
    problems += [p for i, leaf in enumerate(leaves) for p in range_problems(f"batch leaf #{i}", leaf)]
    raise_if_any(problems, header=f"batch does not fit {made} on {describe_mesh(mesh)}")
    return jax.tree.map(lambda x: wrap(put(x, NamedSharding(mesh, batch_leaf_spec(x, made)))), batch)


def leaf_problems(name: str, leaf: Any) -> list[str]:
    """A batch leaf must be an array with values: a torch tensor (not on meta), a numpy or a jax array.

    Examples:
        >>> leaf_problems("batch leaf #0", "abc")
        ['batch leaf #0 is a str; pass torch tensors, numpy or jax arrays (e.g. torch.tensor(...))']
    """
    if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
        return [f"{name} {tuple(leaf.shape)} is on the meta device (no values); pass a tensor with data"]
    if isinstance(leaf, torch.Tensor | np.ndarray | jax.Array):
        return []
    return [f"{name} is a {type(leaf).__name__}; pass torch tensors, numpy or jax arrays (e.g. torch.tensor(...))"]
