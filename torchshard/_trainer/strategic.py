"""The strategies half of a `Trainer`: its bound strategies, the idle time they leave, the kernels they chose."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from torchshard._train.strategy import Bound


class Strategic:
    """What a `Trainer` says about its parallel strategies (one per strategy keyword)."""

    _strategies: dict[str, Bound]

    @property
    def strategies(self) -> Mapping[str, Bound]:
        """Trainer keyword → its bound strategy (``.option`` is what the keyword resolved to: e.g.
        ``strategies["expert_dispatch"].option`` is ``ExpertDispatch()`` where all-to-all runs), read-only."""
        return types.MappingProxyType(self._strategies)

    @property
    def idle_fraction(self) -> float:
        """The fraction of the devices' time the strategies leave idle: a pipeline's bubble,
        ``(S-1)/(repeats*M + S-1)`` (``2(S-1)/(3M + 2(S-1))`` under ``"zero_bubble"``); 0.0 without one."""
        return sum(s.idle_fraction for s in self._strategies.values())

    @property
    def kernels(self) -> dict[str, Any]:
        """The kernel each attention call site got and why (``attention_kernel=``), once the step is traced."""
        return {site: choice for s in self._strategies.values() for site, choice in s.kernels().items()}
