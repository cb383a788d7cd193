"""``Trainer(fused_loss=)``: a transformers causal LM's loss taken from its LM head's input, chunked over tokens.

While the step is traced, each recognised model's ``lm_head`` records (its input, its weight,
its output) and the model's ``loss_function`` is wrapped: when the logits it is handed are, by
identity, a recorded head output, it computes transformers' ``ForCausalLMLoss`` (label shift,
``ignore_index``, ``num_items_in_batch``, ``shift_labels``) with `linear_cross_entropy` on the
head's input instead. Anything done to the logits in between (a soft cap, a scale) makes a new
tensor, so the identity check fails and the model's own loss runs. The full logits stay the
model's output; when nothing reads them, XLA drops them from the compiled step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.ops.linear_cross_entropy import head_loss
from torchshard._train.strategy import Bound, Setting, Strategy

_log = logging.getLogger(__name__)
Records = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # id(logits) → (logits, hidden, weight)


def _loss_utils() -> Any:
    """transformers' loss module, if transformers is loaded (a model of it can exist only then)."""
    return sys.modules.get("transformers.loss.loss_utils")


def _head(module: torch.nn.Module, causal_lm_loss: Callable[..., Any], mapping: dict[str, Any]) -> Any:
    """``module``'s LM head if it is a transformers model whose loss is the causal-LM loss, else None.

    The loss is read as transformers' ``loss_function`` property reads it, without calling it (which
    logs a warning on models with no loss type). Only a bias-free ``nn.Linear`` head is taken.
    """
    if not callable(getattr(module, "get_output_embeddings", None)) or "loss_function" not in dir(type(module)):
        return None
    own = vars(module).get("_loss_function")
    loss = own if own is not None else mapping.get(getattr(module, "loss_type", None) or "")
    if loss is not causal_lm_loss:
        return None
    try:
        head = module.get_output_embeddings()  # type: ignore[operator]  # checked callable above
    except (AttributeError, NotImplementedError):
        return None
    return head if type(head) is torch.nn.Linear and head.bias is None else None


def _recorder(records: Records) -> Callable[..., None]:
    def record(head: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        weight = head.weight
        if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
            assert isinstance(weight, torch.Tensor)  # an nn.Linear's (see _head)
            records[id(output)] = (output, args[0], weight)

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
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss(logits, ...)`` for ``logits = hidden @ weight.T``, without the logits.

    Labels are shifted left (the last position ignored) unless ``shift_labels`` is given; the mean
    is over labels that are not ``ignore_index``, or the sum over ``num_items_in_batch``. In float32.
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
        hidden, weight, shift, ignore_index=ignore_index, reduction="mean" if items is None else "sum", float32_out=True
    )
    return loss if items is None else loss / items


def _fused(original: Callable[..., Any], records: Records, owner: str) -> Callable[..., Any]:
    """``original`` (transformers' causal-LM loss of model ``owner``) computed by `causal_lm_loss` on logits a
    head recorded."""
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
        if seen is None or seen[0] is not logits or not _fits(logits, seen[1], seen[2], arguments):
            _log.debug("%s: its loss got logits other than its LM head's output (e.g. soft-capped): not fused", owner)
            return original(*args, **kwargs)
        _log.debug("%s: loss fused with its LM head (linear_cross_entropy)", owner)
        return causal_lm_loss(seen[1], seen[2], logits.dtype, arguments)

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
def fused_head_losses(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, every transformers causal LM in ``model`` computes its loss by `causal_lm_loss`.

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
    with contextlib.ExitStack() as stack:
        for module, head in found:
            stack.callback(head.register_forward_hook(_recorder(records)).remove)
            stack.enter_context(_loss_replaced(module, _fused(causal, records, type(module).__name__)))
        try:
            yield
        finally:
            records.clear()


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedLoss(Bound):
    """While the step is traced, transformers causal LMs in the model take their loss from the LM head's input."""

    option: bool = True
    model: Any = dataclasses.field(default=None, compare=False, repr=False)

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        return fused_head_losses(self.model)


def bind(fused: Any, setting: Setting) -> Bound:
    """``Trainer(fused_loss=)``: on unless ``False``.

    Raises:
        ArgumentError: ``fused`` is not a bool.
    """
    if fused is not None and not isinstance(fused, bool):
        raise_for_arguments(
            [f"fused_loss must be True or False, got {fused!r:.40}"], header="invalid Trainer arguments"
        )
    if fused is False:
        return Bound(option=False)
    return FusedLoss(option=True, model=setting.model)


STRATEGY = Strategy(keyword="fused_loss", option=bool, bind=bind)
