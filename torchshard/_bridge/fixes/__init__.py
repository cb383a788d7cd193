"""Workarounds for upstream bugs, one file each, naming the bug and gated on the versions that have it.

May import the rest of _bridge and _base.
"""
