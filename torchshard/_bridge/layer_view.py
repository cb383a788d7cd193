"""Per-layer tensors that read one layer of a stacked array: a scanned Trainer's module weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import torch

from torchshard._bridge.env import env
from torchshard._bridge.loaded import Tensor, mappings
from torchshard._bridge.module_tensors import named_tensors, set_tensor


class StackedArray:
    """An array whose leading dim stacks layers, read one layer at a time by `LayerView` s."""

    def __init__(self, array: jax.Array) -> None:
        self.array = array

    def replace(self, array: jax.Array) -> None:
        """Points every view at a new stacked array (after a training step)."""
        self.array = array

    def layer(self, index: int) -> jax.Array:
        """Layer ``index`` of the current array (a fresh slice: nothing is kept, so memory stays bounded)."""
        return self.array[index]


class LayerView(Tensor):
    """A torchax tensor that is one layer of a `StackedArray`, always the current one, sliced when read.

    A scanned Trainer keeps each layer's weights only in stacked arrays; its module's per-layer
    parameters are these views, so ``trainer.model`` reads the latest values without a copy per step.
    """

    @staticmethod
    def __new__(cls, stack: StackedArray, index: int, *, param: bool = False, requires_grad: bool = False):
        like = jax.ShapeDtypeStruct(stack.array.shape[1:], stack.array.dtype)
        return Tensor.__new__(cls, like, env(), requires_grad)

    def __init__(self, stack: StackedArray, index: int, *, param: bool = False, requires_grad: bool = False) -> None:
        # torchax's __init__ would store a concrete array; a view reads its stack instead
        self._stack, self._index, self._env = stack, index, env()
        if param:
            self._is_param = True  # what makes isinstance(view, torch.nn.Parameter) true, as for torchax params

    # shape and dtype come from the stack: torchax reads them through _elem, which would slice the layer out (a
    # device copy and an eager gather per read; building a Trainer reads them hundreds of times)
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._stack.array.shape[1:])

    @property
    def ndim(self) -> int:
        return self._stack.array.ndim - 1

    def dim(self) -> int:
        return self.ndim

    @property
    def dtype(self) -> torch.dtype:
        return mappings.j2t_dtype(self._stack.array.dtype)

    @property
    def _elem(self) -> jax.Array:  # private: torchax reads the wrapped array from this attribute
        return self._stack.layer(self._index)

    @_elem.setter
    def _elem(self, value: jax.Array) -> None:
        raise RuntimeError(
            "this tensor is one layer of a scanned Trainer's stacked weights and cannot be written in place; "
            "change the weights through a checkpoint (torchshard.load) or build the Trainer with scan_layers=False"
        )


def view_stacks(
    model: torch.nn.Module, stacks: Mapping[str, tuple[Sequence[str], jax.Array]]
) -> dict[str, StackedArray]:
    """Each layer's tensor (``names`` in stack order) becomes a `LayerView` of its stacked array: no per-layer copy.

    Returns the `StackedArray` of each key, whose `StackedArray.replace` moves every view of it to a new array.
    """
    tensors = named_tensors(model)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    stacked = {}
    for key, (names, array) in stacks.items():
        stacked[key] = stack = StackedArray(array)
        for i, name in enumerate(names):
            param = name in params
            set_tensor(
                model, name, LayerView(stack, i, param=param, requires_grad=tensors[name].requires_grad), param=param
            )
    return stacked
