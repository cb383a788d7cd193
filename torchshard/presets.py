"""Ready-made rule tables: replicated, data parallel, FSDP, tensor parallel and Hugging Face tp_plans."""

from torchshard._hf import from_hf_tp_plan, hf_rules, validate_hf_config
from torchshard._presets import common_tensor_parallel, data_parallel, fsdp, replicated, tensor_parallel

__all__ = [
    "common_tensor_parallel",
    "data_parallel",
    "from_hf_tp_plan",
    "fsdp",
    "hf_rules",
    "replicated",
    "tensor_parallel",
    "validate_hf_config",
]
