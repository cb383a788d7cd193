"""Multi-process runs: joining JAX's multi-controller runtime, the local launcher, its workers and hang watchdog.

May import _spmd, _presets, _sharding, _bridge and _base.
"""
