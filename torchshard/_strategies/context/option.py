"""``Trainer(context=ContextParallel(...))``: the option, checked as it is made, and against the mesh and batch spec."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec

from torchshard._base.errors import raise_if_any
from torchshard._base.specs import entry_axes
from torchshard._base.validate import AnyMesh, describe_mesh, instance_problems, raise_for_arguments

ATTENTIONS = ("ring", "all_gather")
SUPPORTED = (
    "context-parallel attention supports no mask, is_causal=True, a constant causal mask (e.g. "
    "torch.ones(S, S, dtype=torch.bool).tril()) or causal sliding window (transformers' sliding_window), or packed "
    "documents (ts.document_mask(position_ids), or transformers' position_ids restarting per document), with dropout 0"
)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Context (sequence) parallelism for ``Trainer(..., context=...)``.

    Batch tensors are split on dim 1 (the sequence) over ``axis`` (``batch_spec=("data", "context")``);
    the model runs as written and every ``torch.nn.functional.scaled_dot_product_attention`` call in
    it (transformers' default ``sdpa`` attention included) runs as attention over the whole sequence
    while each device holds only its part. Causal or not, no mask, the causal mask or a causal
    sliding window, grouped K/V heads; other mesh axes keep sharding the batch, the heads and the
    weights as the plan says. A model whose step calls no SDPA (its own attention, as
    transformers' ``eager``) trains with the sequence gathered for it, said by a `ContextParallelWarning`.

    Args:
        axis: the mesh axis the sequence is split over.
        attention: ``"ring"``: key/value blocks pass round the axis by ``ppermute`` while each device
            folds them into an online softmax, so a device holds O(S/n) keys and one (S/n)² block of
            scores; the backward pass runs the ring again. ``"all_gather"``: every device gathers all
            keys/values (O(S) memory) and runs the same blockwise softmax on them.
        load_balance: under a causal mask, reorder the rows inside the attention (device ``i`` takes
            chunks ``i`` and ``2n-1-i`` of ``2n``) so every device does the same work; the model, its
            positions and the batch are unchanged. Sequences must then split into ``2n`` chunks.

    Raises:
        ArgumentError: an argument of the wrong type or value (all listed).

    Examples:
        >>> ContextParallel(attention="all_gather")
        ContextParallel(axis='context', attention='all_gather', load_balance=True)
    """

    axis: str = "context"
    attention: str = "ring"
    load_balance: bool = True

    def __post_init__(self) -> None:
        problems = [] if isinstance(self.axis, str) else [f"axis={self.axis!r} must be a mesh axis name"]
        if self.attention not in ATTENTIONS:
            problems.append(f"attention={self.attention!r} must be one of {list(ATTENTIONS)}")
        if not isinstance(self.load_balance, bool):
            problems.append(f"load_balance={self.load_balance!r} must be True or False")
        raise_for_arguments(problems, header="invalid ContextParallel arguments")


def check_context(context: Any, mesh: AnyMesh, batch_spec: PartitionSpec) -> None:
    """Raises unless ``context`` (None or a `ContextParallel`) fits ``mesh`` and ``batch_spec``.

    Raises:
        ArgumentError: ``context`` is not a `ContextParallel`.
        ShardingError: its axis is not in the mesh, or ``batch_spec`` does not split dim 1 over it.
    """
    if context is None:
        return
    raise_for_arguments(
        instance_problems("context", context, ContextParallel, "a ContextParallel(...) or None"),
        header="invalid Trainer arguments",
    )
    axis, problems = context.axis, []
    if axis not in mesh.shape:
        problems.append(
            f"axis {axis!r} is not an axis of {describe_mesh(mesh)}; add it (e.g. make_mesh({{'data': 2, "
            f"{axis!r}: 4}})) or name one of {list(mesh.shape)}"
        )
    dims = [entry_axes(entry) for entry in batch_spec]
    if len(dims) < 2 or axis not in dims[1]:
        problems.append(
            f"batch_spec {batch_spec} does not split the sequence (dim 1) over {axis!r}; write "
            f"batch_spec=('data', {axis!r}) (the batch over 'data', the sequence over {axis!r})"
        )
    raise_if_any(problems, header=f"{context} does not fit {describe_mesh(mesh)}")
