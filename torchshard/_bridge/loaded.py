"""torchax, imported once inside the workarounds its import needs; every other module takes torchax from here."""

from __future__ import annotations

import importlib

from torchshard._bridge.fixes import named_overloads

with named_overloads.import_shim():
    # torchax imports these lazily when its first environment is created; importing them here,
    # inside the shim's window, keeps the window closed afterwards and creates no environment
    # (which would start the JAX backend).
    for _name in ("torchax", "torchax.decompositions", "torchax.amp", "torchax.interop"):
        importlib.import_module(_name)

import torchax
from torchax import amp, interop
from torchax.ops import mappings, ops_registry
from torchax.tensor import TENSOR_CONSTRUCTORS, Environment, OperatorNotFound, Tensor
from torchax.view import View, ViewInfo, ViewInfoType

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
