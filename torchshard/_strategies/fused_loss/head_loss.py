"""A transformers causal LM's loss taken from its LM head's input, chunked over tokens, while the step is traced."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from torchshard._bridge.ops import tokamax_loss
from torchshard._bridge.ops.linear_cross_entropy import head_loss

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Written:
    """What a tensor held when the head ran: its version counter and (on torchax) its JAX array.

    torch bumps the counter on in-place ops; torchax's ``__setitem__`` does not, but replaces the array.
    """

    version: int
    array: Any

    @classmethod
    def of(cls, t: torch.Tensor) -> _Written:
        return cls(t._version, getattr(t, "_elem", None))

    def same(self, t: torch.Tensor) -> bool:
        return t._version == self.version and getattr(t, "_elem", None) is self.array


@dataclasses.dataclass(frozen=True)
class _Record:
    """One call of an LM head: its output, input and weight, and what each held then."""

    logits: torch.Tensor
    hidden: torch.Tensor
    weight: torch.Tensor
    written: tuple[_Written, _Written, _Written]

    def changed(self) -> str | None:
        """Which of the three was written in place since the head ran, if any."""
        names = ("logits", "head's input", "head's weight")
        tensors = (self.logits, self.hidden, self.weight)
        return next((n for n, t, w in zip(names, tensors, self.written, strict=True) if not w.same(t)), None)


Records = dict[int, _Record]  # id(logits) → the head call that made them
# (the model's name, the head's name, the loss' call) → tokamax's implementation, or None: torchshard's chunks
Chooser = Callable[[str, str, tokamax_loss.LossCall], str | None]


def _loss_utils() -> Any:
    """transformers' loss module, if transformers is loaded (a model of it can exist only then)."""
    return sys.modules.get("transformers.loss.loss_utils")


def _head(module: torch.nn.Module, causal_lm_loss: Callable[..., Any], mapping: dict[str, Any]) -> Any:
    """``module``'s LM head if it is a transformers model whose loss is the causal-LM loss, else None.

    The loss is read as transformers' ``loss_function`` property reads it, without calling it (which
    logs a warning on models with no loss type).
    """
    if not callable(getattr(module, "get_output_embeddings", None)) or "loss_function" not in dir(type(module)):
        return None
    own = vars(module).get("_loss_function")
    loss = own if own is not None else mapping.get(getattr(module, "loss_type", None) or "")
    if loss is not causal_lm_loss:
        return None
    try:
        return module.get_output_embeddings()  # type: ignore[operator]  # checked callable above
    except (AttributeError, NotImplementedError):
        return None


def _unfusable(module: torch.nn.Module, head: Any) -> str | None:
    """Why the loss of ``module`` (a causal LM whose head is ``head``) cannot be computed from the head's input."""
    if not (type(head) is torch.nn.Linear and head.bias is None):
        return f"its LM head is a {type(head).__name__}, not a bias-free nn.Linear"
    base = sys.modules.get("transformers.modeling_utils")
    ours = inspect.getattr_static(getattr(base, "PreTrainedModel", object), "loss_function", None)
    if inspect.getattr_static(type(module), "loss_function", None) is not ours:
        return f"{type(module).__name__} overrides transformers' loss_function"
    return None


def _hooked(head: torch.nn.Module) -> str | None:
    """Why ``head``'s output may not be ``hidden @ weight.T`` (beyond its own forward), if it may not."""
    if "forward" in vars(head):
        return "its LM head's forward is replaced on the instance"
    global_hooks = torch.nn.modules.module._global_forward_hooks.values()
    if len(head._forward_hooks) > 1 or any(not _torchshards(h) for h in global_hooks):
        return "its LM head has forward hooks, which may change its output"
    return None


def _torchshards(hook: Any) -> bool:
    return getattr(hook, "__module__", "").startswith("torchshard.")


def _recorder(records: Records, owner: str) -> Callable[..., None]:
    def record(head: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        weight = head.weight
        if (reason := _hooked(head)) is not None:
            _log.info("%s: loss not fused: %s", owner, reason)
        elif args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
            assert isinstance(weight, torch.Tensor)  # an nn.Linear's (see _unfusable)
            tensors = (output, args[0], weight)
            records[id(output)] = _Record(*tensors, tuple(_Written.of(t) for t in tensors))  # type: ignore[arg-type]

    return record


def _fits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, arguments: dict[str, Any]) -> bool:
    """Whether the call's arguments are those the chunked loss reproduces (else the model's own loss runs)."""
    labels, shift = arguments.get("labels"), arguments.get("shift_labels")
    target = shift if shift is not None else labels
    vocab, width = weight.shape
    return (
        isinstance(target, torch.Tensor)
        and hidden.shape[-1] == width
        and tuple(logits.shape) == (*hidden.shape[:-1], vocab)
        and arguments.get("vocab_size") == vocab
        and target.numel() == logits.numel() // max(vocab, 1)
        and isinstance(arguments.get("ignore_index", -100), int)
    )


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    logits_dtype: torch.dtype,
    arguments: dict[str, Any],
    implementation: str | None = None,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss(logits, ...)`` for ``logits = hidden @ weight.T``, without the logits.

    Labels are shifted left (the last position ignored) unless ``shift_labels`` is given; the mean
    is over labels that are not ``ignore_index``, or the sum over ``num_items_in_batch``. In float32.
    ``implementation``: tokamax's (`tokamax_loss.IMPLEMENTATIONS`) instead of torchshard's chunks.
    """
    ignore_index = arguments.get("ignore_index", -100)
    shift = arguments.get("shift_labels")
    if shift is None:
        padded = torch.nn.functional.pad(arguments["labels"], (0, 1), value=ignore_index)
        shift = padded[..., 1:]
    items = arguments.get("num_items_in_batch")
    if tuple(shift.shape) != tuple(hidden.shape[:-1]):  # e.g. flat shift_labels: flatten both alike
        hidden, shift = hidden.reshape(-1, hidden.shape[-1]), shift.reshape(-1)
    # the head's own operands: under autocast (or mixed dtypes, which torchax promotes) F.linear cast them so
    hidden, weight = hidden.to(logits_dtype), weight.to(logits_dtype)
    loss = head_loss(
        hidden,
        weight,
        shift,
        ignore_index=ignore_index,
        reduction="mean" if items is None else "sum",
        float32_out=True,
        implementation=implementation,
    )
    return loss if items is None else loss / items


def _loss_call(head: str, hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> tokamax_loss.LossCall:
    tokens = hidden.numel() // max(hidden.shape[-1], 1)
    as_numpy = np.dtype(jnp.dtype(str(dtype).removeprefix("torch.")))  # torch's float dtypes are named as JAX's
    return tokamax_loss.LossCall(head, tokens, weight.shape[1], weight.shape[0], as_numpy)


def _fused(
    original: Callable[..., Any], records: Records, owner: str, head: str, choose: Chooser | None
) -> Callable[..., Any]:
    """``original`` (transformers' causal-LM loss of model ``owner``) computed by `causal_lm_loss` on logits a
    head (named ``head``) recorded; ``choose`` says whose loss computes it."""
    signature = inspect.signature(original)

    def loss_function(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # its own error
        bound.apply_defaults()
        arguments = {**bound.arguments, **bound.arguments.get("kwargs", {})}
        logits = arguments.get("logits")
        seen = records.get(id(logits))
        if seen is None or seen.logits is not logits:
            _log.info("%s: its loss got logits other than its LM head's output (e.g. soft-capped): not fused", owner)
            return original(*args, **kwargs)
        if (changed := seen.changed()) is not None:
            _log.info("%s: the %s was written in place after the LM head ran: loss not fused", owner, changed)
            return original(*args, **kwargs)
        if not _fits(logits, seen.hidden, seen.weight, arguments):
            _log.info("%s: its loss was called with arguments the fused loss does not take: not fused", owner)
            return original(*args, **kwargs)
        implementation = None
        if choose is not None:
            implementation = choose(owner, head, _loss_call(head, seen.hidden, seen.weight, logits.dtype))
        _log.debug("%s: loss fused with its LM head (%s)", owner, implementation or "linear_cross_entropy")
        return causal_lm_loss(seen.hidden, seen.weight, logits.dtype, arguments, implementation)

    return loss_function


@contextlib.contextmanager
def _loss_replaced(module: torch.nn.Module, loss_function: Callable[..., Any]) -> Iterator[None]:
    """Inside the block, transformers' ``loss_function`` property of ``module`` returns ``loss_function``."""
    own = vars(module)
    had, previous = "_loss_function" in own, own.get("_loss_function")
    own["_loss_function"] = loss_function  # what the property's setter stores and its getter reads first
    try:
        yield
    finally:
        if had:
            own["_loss_function"] = previous
        else:
            del own["_loss_function"]


@contextlib.contextmanager
def fused_head_losses(model: torch.nn.Module, choose: Chooser | None = None) -> Iterator[None]:
    """Inside the block, every transformers causal LM in ``model`` computes its loss by `causal_lm_loss`
    (with the implementation ``choose`` gives, where given).

    Each recognised model's ``lm_head`` records (its input, its weight, its output) and the model's
    ``loss_function`` is wrapped: when the logits it is handed are, by identity, a recorded head
    output that nothing has written to since, it computes transformers' ``ForCausalLMLoss`` (label
    shift, ``ignore_index``, ``num_items_in_batch``, ``shift_labels``) with `linear_cross_entropy` on
    the head's input instead. The rewrite proves that at every call, and steps aside (the model's own
    loss runs, and the ``torchshard`` logger says why at INFO) where it cannot: logits that are a new
    tensor (a soft cap, a scale), logits or the head's input written in place since the head made
    them (Chameleon masks its image tokens' logits so, xLSTM soft-caps in place), a head with forward
    hooks of its own or an instance ``forward``, a model class that overrides transformers'
    ``loss_function``, and a head that is not a bias-free ``nn.Linear`` (a peft LoRA layer). The full
    logits stay the model's output; when nothing reads them, XLA drops them from the compiled step.

    Examples:
        >>> with fused_head_losses(torch.nn.Linear(2, 2)):  # no transformers model inside: nothing changes
        ...     pass
    """
    utils = _loss_utils()
    causal = getattr(utils, "ForCausalLMLoss", None)
    if causal is None:
        yield
        return
    found = [(m, h) for m in model.modules() if (h := _head(m, causal, utils.LOSS_MAPPING)) is not None]
    records: Records = {}
    names = {id(m): name for name, m in model.named_modules()}
    with contextlib.ExitStack() as stack:
        for module, head in found:
            owner = type(module).__name__
            if (reason := _unfusable(module, head)) is not None:
                _log.info("%s: loss not fused: %s", owner, reason)
                continue
            stack.callback(head.register_forward_hook(_recorder(records, owner)).remove)
            fused = _fused(causal, records, owner, names.get(id(head), ""), choose)
            stack.enter_context(_loss_replaced(module, fused))
        try:
            yield
        finally:
            records.clear()
