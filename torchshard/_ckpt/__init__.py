"""The native checkpoint: save/load, crash-consistent step directories, orbax, shard files, checksums.

May import _generate and everything below it.
"""
