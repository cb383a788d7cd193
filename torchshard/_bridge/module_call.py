"""A torch module's forward as a pure JAX function of its tensors and its call's tensor arguments.

Activation checkpointing (``jax.checkpoint``) and scanned layers (``lax.scan``) both need the
forward of a torch module as a function of arrays only: these helpers split a call's arguments
into arrays and everything else, bind arrays into the module, and read the outputs, any buffer
the forward updated, and what its submodules' forward hooks saw back out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import torch
import torch.utils._pytree as torch_pytree

from torchshard._base.errors import ShardingError
from torchshard._bridge.env import current_key, seeded
from torchshard._bridge.loaded import View
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
    # a torchax view (x[:, None], x.T) is a tensor too: left a static leaf, a pipeline would give it whole to
    # every micro-batch and a scan would close over it
    leaves = [leaf.torch() if isinstance(leaf, View) else leaf for leaf in leaves]
    tensor_at = tuple(i for i, leaf in enumerate(leaves) if is_jax_tensor(leaf))
    arrays = [unwrap(leaves[i]) for i in tensor_at]
    rest = tuple(None if i in tensor_at else leaf for i, leaf in enumerate(leaves))
    return arrays, Split(treedef, rest, tensor_at)


def argument_names(forward: Callable[..., Any], call: Split) -> tuple[str, ...]:
    """A name for each tensor of a ``(args, kwargs)`` call: its parameter in ``forward``'s signature, or its place.

    Examples:
        >>> _, call = split(((1, {"x": 2}), {"mask": 3}))
        >>> argument_names(lambda h, extra, mask=None: h, dataclasses.replace(call, tensor_at=(0, 1, 2)))
        ('h', "extra['x']", 'mask')
    """
    try:
        positional = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        positional = []
    indexed = torch_pytree.tree_unflatten(list(range(len(call.leaves))), call.treedef)  # leaf i holds i
    names: dict[int, str] = {}
    for path, leaf in torch_pytree.tree_flatten_with_path(indexed)[0]:
        where: Any = path[0]  # (args, kwargs)[0 or 1]
        top: Any = path[1]  # an args index or a keyword
        inner = torch_pytree.keystr(path[2:])
        if where.idx == 1:
            names[leaf] = f"{top.key}{inner}"
        else:
            names[leaf] = f"{positional[top.idx] if top.idx < len(positional) else f'args[{top.idx}]'}{inner}"
    return tuple(names[i] for i in call.tensor_at)


def module_arrays(module: torch.nn.Module) -> tuple[dict[str, jax.Array], list[str]]:
    """The arrays currently bound to ``module``'s tensors (by name), and which names are buffers."""
    tensors = model_tensors(module)
    arrays = {t.name: unwrap(t.tensor) for t in tensors if is_jax_tensor(t.tensor)}
    buffers = [t.name for t in tensors if t.kind == "buffer" and t.name in arrays]
    return arrays, buffers


@dataclasses.dataclass(frozen=True)
class HookCall:
    """One call of a submodule's forward hook inside a traced body, replayed outside it.

    Hooks record what a forward produced (transformers' router logits for the MoE aux loss,
    attentions, hidden states) into Python lists; run inside ``jax.checkpoint`` or ``lax.scan``,
    they would keep tracers of the body. So inside the body a hook's arguments are recorded and
    become outputs of the body, and the hook runs after it on those.
    """

    hook: Callable[..., Any]
    module: torch.nn.Module
    with_kwargs: bool
    arguments: Split  # (args, kwargs, output) of the hooked module's call

    def replay(self, arrays: Sequence[jax.Array]) -> None:
        """Calls the hook with its arguments rebuilt from ``arrays`` (values outside the body)."""
        args, kwargs, output = self.arguments.rebuild(arrays)
        given = (args, kwargs, output) if self.with_kwargs else (args, output)
        result = self.hook(self.module, *given)
        if result is not None:
            raise ShardingError(
                f"a forward hook of {type(self.module).__name__} ({getattr(self.hook, '__qualname__', self.hook)}) "
                f"inside a checkpointed (remat=) or scanned (scan_layers=) module returns a new output; there hooks "
                f"run after the module, on its outputs carried out, so they may record outputs but not replace "
                f"them: register it on a module outside the remat/scan targets, or leave this module out of them"
            )


def _recorder(calls: list[tuple[HookCall, list[jax.Array]]], hook: Callable[..., Any], with_kwargs: bool):
    def record(module: torch.nn.Module, args: Any, *rest: Any) -> None:
        kwargs, output = (rest[0], rest[1]) if with_kwargs else ({}, rest[0])
        arrays, arguments = split((args, kwargs, output))
        calls.append((HookCall(hook, module, with_kwargs, arguments), arrays))

    return record


@contextlib.contextmanager
def deferred_hooks(module: torch.nn.Module) -> Iterator[list[tuple[HookCall, list[jax.Array]]]]:
    """Inside the block, forward hooks of ``module``'s submodules record their calls instead of running.

    ``module``'s own hooks are left alone: torch runs them around the (wrapped) forward, outside.
    """
    calls: list[tuple[HookCall, list[jax.Array]]] = []
    swapped = []
    for sub in module.modules():
        if sub is module:
            continue
        for hook_id, hook in list(sub._forward_hooks.items()):
            swapped.append((sub, hook_id, hook))
            sub._forward_hooks[hook_id] = _recorder(calls, hook, hook_id in sub._forward_hooks_with_kwargs)
    try:
        yield calls
    finally:
        for sub, hook_id, hook in swapped:
            sub._forward_hooks[hook_id] = hook


@dataclasses.dataclass
class PureForward:
    """``forward`` of ``module`` as ``(state, inputs, key) -> (outputs, new buffers, key after, hooked)`` over arrays.

    Random ops inside draw from ``key`` in turn and the last key comes back out, so the caller
    can continue the same key sequence as an unwrapped forward would. The structure of the
    outputs (and their non-tensor leaves) is recorded when the function is traced; `rebuild`
    puts torch values back together from the output arrays. ``hooked`` holds the arrays the
    submodules' forward hooks saw (see `HookCall`); `replay_hooks` runs the hooks on them.
    """

    module: torch.nn.Module
    forward: Forward
    inputs: Split
    buffers: Sequence[str]
    output: Split | None = None
    hooks: list[HookCall] = dataclasses.field(default_factory=list)

    def __call__(self, state: Mapping[str, jax.Array], inputs: Sequence[jax.Array], key: jax.Array):
        values = {name: wrap(array) for name, array in state.items()}
        with seeded(key), bound(self.module, values), deferred_hooks(self.module) as calls:
            args, kwargs = self.inputs.rebuild(inputs)
            out = self.forward(*args, **kwargs)
            key = current_key()
        arrays, self.output = split(out)
        self.hooks = [call for call, _ in calls]  # the last trace's: a traced function may be traced again
        hooked = [array for _, call_arrays in calls for array in call_arrays]
        return arrays, {name: unwrap(values[name]) for name in self.buffers}, key, hooked

    def replay_hooks(self, arrays: Sequence[jax.Array]) -> None:
        """Runs the recorded hook calls, in order, on ``hooked`` arrays of a call (values outside the body)."""
        at = 0
        for call in self.hooks:
            count = len(call.arguments.tensor_at)
            call.replay(arrays[at : at + count])
            at += count

    def rebuild(self, arrays: Sequence[jax.Array]) -> Any:
        """The forward's torch output from the output arrays of a call."""
        assert self.output is not None, "rebuild() before the function was traced"
        return self.output.rebuild(arrays)
