"""Torch-facing ``shard_map`` and the ``jax.lax`` collectives, on torchax tensors."""

from torchshard._spmd.collective_ops import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    fold_rng,
    pmean,
    ppermute,
    psum,
    psum_scatter,
    use_rng,
)
from torchshard._spmd.shard_map import shard_map

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
