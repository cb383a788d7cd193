"""Torch-facing shard_map and the jax.lax collectives on torchax tensors.

May import _presets, _sharding, _bridge and _base.
"""
