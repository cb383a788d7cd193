"""A Trainer's batches: checked against its batch spec and strategies, placed on its mesh."""

from __future__ import annotations

from typing import Any

import jax

from torchshard._base.errors import raise_if_any
from torchshard._base.validate import describe_mesh, raise_for_arguments
from torchshard._sharding.placement import put
from torchshard._train.strategy import leaf_problems
from torchshard._trainer.checks import batch_type_problems
from torchshard._trainer.core import Core


def batch_problems(core: Core, index: int, leaf: Any, *, local: bool = False, steps: int | None = None) -> list[str]:
    """Why batch leaf number ``index`` does not fit the batch spec, split into ``steps`` micro-batches."""
    steps = core.options.grad_accum_steps if steps is None else steps
    return leaf_problems(core.batch, list(core.strategies.values()), steps, index, leaf, local=local)


def raise_for_batch(core: Core, leaves: list[Any], *, local: bool = False, steps: int | None = None) -> None:
    """Raises one `ShardingError` naming every leaf that does not fit the batch spec on the mesh."""
    problems = [p for i, leaf in enumerate(leaves) for p in batch_problems(core, i, leaf, local=local, steps=steps)]
    spec = core.options.batch_spec
    raise_if_any(problems, header=f"batch does not fit batch_spec {spec} on {describe_mesh(core.mesh)}")


def place_batch(core: Core, batch: Any, *, local: bool = False, steps: int | None = None) -> Any:
    """Every leaf of ``batch`` placed with the batch spec (`Trainer.place_batch`)."""
    leaves = jax.tree.leaves(batch)
    if not local and all(isinstance(x, jax.Array) and x.sharding == core.batch.sharding(x) for x in leaves):
        return batch  # already placed (by place_batch or prefetch): nothing to check or move
    raise_for_arguments(batch_type_problems(leaves), header="invalid batch")
    raise_for_batch(core, leaves, local=local, steps=steps)
    return jax.tree.map(lambda x: put(x, core.batch.sharding(x), process_local=local), batch)
