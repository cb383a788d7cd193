"""Parallel strategies run inside the training step: pipeline, context-parallel attention, expert dispatch.

May import _multihost, _spmd, _presets, _sharding, _bridge and _base.
"""
