"""torchax, imported once inside the workarounds its import needs; every other module takes torchax from here."""

from __future__ import annotations

import importlib

from torchshard._bridge.fixes import accelerator_probe, removed_aten

with removed_aten.import_shim():
    # torchax imports these lazily when its first environment is created; importing them here,
    # inside the shim's window, keeps the window closed afterwards and creates no environment
    # (which would start the JAX backend). The torchax.ops tables are what Environment.load_ops imports.
    for _name in (
        "torchax",
        "torchax.decompositions",
        "torchax.amp",
        "torchax.interop",
        "torchax.ops.jaten",
        "torchax.ops.jc10d",
        "torchax.ops.jtorch",
        "torchax.ops.jtorchvision_nms",
    ):
        importlib.import_module(_name)

import torchax
from torchax import amp, interop
from torchax.ops import mappings, ops_registry
from torchax.tensor import TENSOR_CONSTRUCTORS, Environment, OperatorNotFound, Tensor
from torchax.view import View, ViewInfo, ViewInfoType

accelerator_probe.hide_streamless_accelerator()  # torchax registered its device on import

__all__ = [
    "TENSOR_CONSTRUCTORS",
    "Environment",
    "OperatorNotFound",
    "Tensor",
    "View",
    "ViewInfo",
    "ViewInfoType",
    "amp",
    "interop",
    "mappings",
    "ops_registry",
    "torchax",
]
