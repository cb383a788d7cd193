"""Checkpoints and exports: save/load, crash-consistent step directories, orbax, checksums, torch exports.

May import _train and everything below it.
"""
