"""torch ops torchshard lowers itself, one family a file; each file registers itself with ``install(tx)``.

May import the rest of _bridge and _base.
"""
