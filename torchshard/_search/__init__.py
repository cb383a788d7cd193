"""Which plan? The layout search over meshes and options, and the analytic cost model that ranks its candidates.

May import _report and everything below it.
"""
