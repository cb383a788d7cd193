"""Everything about torchax: its import and environment, tensor wrapping, workarounds (fixes/), lowerings (ops/).

May import only _base. A workaround is deleted by deleting its file and its line in env.py.
"""
