"""Swapping module instances' forwards for one traced call, then putting back exactly what was there."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

Replace = Callable[[torch.nn.Module, Callable[..., Any]], None]


@contextlib.contextmanager
def replaced_forwards() -> Iterator[Replace]:
    """Yields ``replace(module, forward)``; on exit every replaced module has its own forward again.

    A module that had no instance-level forward gets its class's back; one that had (an earlier
    replacement, e.g. remat around an expert dispatch) gets that one, in reverse order.

    Examples:
        >>> layer = torch.nn.Identity()
        >>> with replaced_forwards() as replace:
        ...     replace(layer, lambda x: x + 1)
        ...     layer(torch.tensor(1))
        tensor(2)
        >>> "forward" in vars(layer)
        False
    """
    saved: list[tuple[torch.nn.Module, bool, Any]] = []

    def replace(module: torch.nn.Module, forward: Callable[..., Any]) -> None:
        saved.append((module, "forward" in vars(module), vars(module).get("forward")))
        module.forward = forward

    try:
        yield replace
    finally:
        for module, had_own, previous in reversed(saved):
            if had_own:
                module.forward = previous
            else:
                del module.forward
