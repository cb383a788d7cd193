"""What a Trainer says about its parallel strategies: the bound strategies, the idle time they leave, the kernels."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from torchshard._train.strategy import Bound
from torchshard._trainer.core import Core


def strategies(core: Core) -> Mapping[str, Bound]:
    """Trainer keyword → its bound strategy, read-only (`Trainer.strategies`)."""
    return types.MappingProxyType(core.strategies)


def idle_fraction(core: Core) -> float:
    """The fraction of the devices' time the strategies leave idle (`Trainer.idle_fraction`)."""
    return sum(s.idle_fraction for s in core.strategies.values())


def kernels(core: Core) -> dict[str, Any]:
    """The kernel each attention call site got and why (`Trainer.kernels`)."""
    return {site: choice for s in core.strategies.values() for site, choice in s.kernels().items()}
