"""Ready-made rule tables: replicated, data parallel, FSDP, tensor and expert parallel, Hugging Face plans."""

from torchshard._presets.hf import hf_rules, validate_hf_config
from torchshard._presets.hf_plan import from_hf_tp_plan
from torchshard._presets.tables import (
    common_tensor_parallel,
    data_parallel,
    expert_parallel,
    fsdp,
    replicated,
    tensor_parallel,
)

__all__ = [
    "common_tensor_parallel",
    "data_parallel",
    "expert_parallel",
    "from_hf_tp_plan",
    "fsdp",
    "hf_rules",
    "replicated",
    "tensor_parallel",
    "validate_hf_config",
]
