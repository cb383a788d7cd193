"""Ready-made rule tables: replicated, data parallel, FSDP, tensor and expert parallel, Hugging Face plans.

May import _sharding, _bridge and _base.
"""
