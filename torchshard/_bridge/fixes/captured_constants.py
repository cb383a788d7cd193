"""torchax refuses plain CPU torch tensors in math with its own tensors; in eager torch they are just values.

A ``loss_fn`` that captures a CPU tensor from outside the model (class weights for
``F.cross_entropy(..., weight=w)``, a mask, a lookup table, another module's buffer) died inside
torchax with ``AssertionError: Expect a Tensor or a View but got <class 'torch.Tensor'>``, naming no
tensor and no fix. Such a tensor holds values known before the step, so, as eager torch would, it is
used as a constant: its values are read once where the op meets it (inside a jitted step, a constant
of the compiled program, which `captures` lists so that a step retraces after the tensor is written
in place). Tensors on ``meta`` have no values and still fail (torchax's message).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from torchshard._bridge import captures
from torchshard._bridge.loaded import Environment, Tensor, View


def _constant(tx: Environment) -> Any:
    def as_constant(x: torch.Tensor) -> Any:
        if isinstance(x, Tensor | View) or x.device.type != "cpu":
            return x
        captures.record(x)
        return Tensor(tx.t2j_copy(x), tx)  # torchax's own host-to-JAX copy, dtypes as JAX holds them

    return as_constant


def _mixed(values: Any) -> bool:
    leaves = torch_pytree.tree_leaves(values)
    ours = any(isinstance(x, Tensor | View) for x in leaves)
    return ours and any(isinstance(x, torch.Tensor) and not isinstance(x, Tensor | View) for x in leaves)


def install(tx: Environment) -> None:
    """In an op that takes torchax tensors, plain CPU torch tensors become constants of their values."""
    original = tx.dispatch

    def dispatch(func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        if _mixed((args, kwargs)):
            args, kwargs = torch_pytree.tree_map_only(torch.Tensor, _constant(tx), (args, kwargs))
        return original(func, types, args, kwargs)

    tx.dispatch = dispatch  # the env's own dispatch, wrapped once per env
