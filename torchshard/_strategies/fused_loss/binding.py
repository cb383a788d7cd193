"""The fused-loss strategy: ``fused_loss=`` bound to the model, and its trace context with the choices it keeps."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Mapping
from typing import Any

from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.ops import kernels, tokamax_loss
from torchshard._strategies.fused_loss.head_loss import fused_head_losses
from torchshard._strategies.fused_loss.option import asks_tokamax, problems
from torchshard._train.strategy import Bound, Setting, Strategy, where

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedLoss(Bound):
    """While the step is traced, transformers causal LMs in the model take their loss from the LM head's input
    (``option="tokamax"``: by tokamax's fused linear softmax cross-entropy where one of its implementations
    takes the call, `tokamax_loss.choose`, else by torchshard's own chunks, saying why; the choices are kept
    by head, in ``trainer.kernels``)."""

    option: bool | str = True
    model: Any = dataclasses.field(default=None, compare=False, repr=False)
    platform: str = "cpu"
    devices: int = 1
    chosen: dict[str, kernels.Choice] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        return fused_head_losses(self.model, self._choose if self.option == "tokamax" else None)

    def _choose(self, owner: str, head: str, call: tokamax_loss.LossCall) -> str | None:
        probe = functools.partial(tokamax_loss.failure, call=call, platform=self.platform)
        choice = tokamax_loss.choose(call, self.platform, devices=self.devices, probe=probe)
        self.chosen.setdefault(head, choice)
        if choice.kernel == tokamax_loss.CHUNKED:
            _log.info("%s: loss fused by torchshard's chunks, not tokamax's (%s)", owner, choice.reason)
            return None
        return choice.kernel.removeprefix("tokamax:")

    def kernels(self) -> Mapping[str, Any]:
        return dict(self.chosen)


def bind(fused: Any, setting: Setting) -> Bound:
    """``Trainer(fused_loss=)``: on unless ``False``; ``"tokamax"``: by tokamax's fused loss where it can.

    Raises:
        ArgumentError: ``fused`` is none of True, False, None and "tokamax", or is "tokamax" where tokamax
            cannot be imported.
    """
    raise_for_arguments(problems(fused), header="invalid Trainer arguments")
    if fused is False:
        return Bound(option=False)
    platform, devices = where(setting)
    option = "tokamax" if asks_tokamax(fused) else True
    return FusedLoss(option=option, model=setting.model, platform=platform, devices=devices)


STRATEGY = Strategy(keyword="fused_loss", option=object, bind=bind)
