"""A torch module's forward as a pure JAX function of its tensors and its call's tensor arguments.

Activation checkpointing (``jax.checkpoint``) and scanned layers (``lax.scan``) both need the
forward of a torch module as a function of arrays only: these helpers split a call's arguments
into arrays and everything else, bind arrays into the module, and read the outputs and any
buffer the forward updated back out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import torch
import torch.utils._pytree as torch_pytree

from torchshard._bridge.env import current_key, seeded
from torchshard._bridge.module_tensors import model_tensors
from torchshard._bridge.tensors import bound, is_jax_tensor, unwrap, wrap

Forward = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Split:
    """A pytree of torch values split into its torchax tensors (as arrays) and everything else."""

    treedef: Any
    leaves: tuple[Any, ...]  # non-tensor leaves in place, None where a tensor was
    tensor_at: tuple[int, ...]

    def rebuild(self, arrays: Sequence[jax.Array]) -> Any:
        """The original pytree with each tensor replaced by a torchax tensor of the given array."""
        leaves = list(self.leaves)
        for position, array in zip(self.tensor_at, arrays, strict=True):
            leaves[position] = wrap(array)
        return torch_pytree.tree_unflatten(leaves, self.treedef)

    def statics(self) -> tuple[Any, ...]:
        """The non-tensor leaves (``None`` where a tensor was)."""
        return self.leaves


def split(tree: Any) -> tuple[list[jax.Array], Split]:
    """``tree``'s torchax tensors as arrays, and how to put it back together."""
    leaves, treedef = torch_pytree.tree_flatten(tree)
    tensor_at = tuple(i for i, leaf in enumerate(leaves) if is_jax_tensor(leaf))
    arrays = [unwrap(leaves[i]) for i in tensor_at]
    rest = tuple(None if i in tensor_at else leaf for i, leaf in enumerate(leaves))
    return arrays, Split(treedef, rest, tensor_at)


def module_arrays(module: torch.nn.Module) -> tuple[dict[str, jax.Array], list[str]]:
    """The arrays currently bound to ``module``'s tensors (by name), and which names are buffers."""
    tensors = model_tensors(module)
    arrays = {t.name: unwrap(t.tensor) for t in tensors if is_jax_tensor(t.tensor)}
    buffers = [t.name for t in tensors if t.kind == "buffer" and t.name in arrays]
    return arrays, buffers


@dataclasses.dataclass
class PureForward:
    """``forward`` of ``module`` as ``(state, inputs, key) -> (outputs, new buffers, key after)`` over arrays.

    Random ops inside draw from ``key`` in turn and the last key comes back out, so the caller
    can continue the same key sequence as an unwrapped forward would. The structure of the
    outputs (and their non-tensor leaves) is recorded when the function is traced; `rebuild`
    puts torch values back together from the output arrays.
    """

    module: torch.nn.Module
    forward: Forward
    inputs: Split
    buffers: Sequence[str]
    output: Split | None = None

    def __call__(self, state: Mapping[str, jax.Array], inputs: Sequence[jax.Array], key: jax.Array):
        values = {name: wrap(array) for name, array in state.items()}
        with seeded(key), bound(self.module, values):
            args, kwargs = self.inputs.rebuild(inputs)
            out = self.forward(*args, **kwargs)
            key = current_key()
        arrays, self.output = split(out)
        return arrays, {name: unwrap(values[name]) for name in self.buffers}, key

    def rebuild(self, arrays: Sequence[jax.Array]) -> Any:
        """The forward's torch output from the output arrays of a call."""
        assert self.output is not None, "rebuild() before the function was traced"
        return self.output.rebuild(arrays)
