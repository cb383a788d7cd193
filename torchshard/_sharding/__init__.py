"""From rules to placed tensors: rule tables, plans, meshes, placement (the one place that moves data), sharded init.

May import _bridge and _base.
"""
