"""The attention-kernel strategy: which kernel each attention call (and, under ``"tokamax"``, each grouped matmul
of experts) gets, chosen while the step is traced."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.ops import kernels
from torchshard._strategies.attention_kernel.option import DEFAULT, problems
from torchshard._train.strategy import Bound, Setting, Strategy, where

logger = logging.getLogger("torchshard")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelChoice(Bound):
    """Every attention call and grouped matmul traced in the step picks its kernel by the option; the choices are
    kept, by call site."""

    option: str = DEFAULT
    platform: str = "cpu"
    devices: int = 1
    chosen: dict[str, kernels.Choice] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @contextlib.contextmanager
    def _choosing(self) -> Iterator[None]:
        before = dict(self.chosen)
        with kernels.choosing(kernels.Policy(self.option, self.platform, self.devices, self.chosen)):
            yield
        if self.chosen != before:
            logger.info("kernels: %s", "; ".join(f"{s or '<top>'}: {c}" for s, c in self.chosen.items()))

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        return self._choosing()

    def kernels(self) -> Mapping[str, Any]:
        return dict(self.chosen)


def bind(option: Any, setting: Setting) -> Bound:
    """``Trainer(attention_kernel=)``: ``"auto"`` (the default), or one of `kernels.KERNELS` forced.

    Raises:
        ArgumentError: ``option`` is not a kernel name.
    """
    raise_for_arguments(problems(option), header="invalid Trainer arguments")
    platform, devices = where(setting)
    return KernelChoice(option=DEFAULT if option is None else option, platform=platform, devices=devices)


STRATEGY = Strategy(keyword="attention_kernel", option=str, bind=bind)
