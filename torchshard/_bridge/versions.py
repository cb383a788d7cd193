"""Installed versions, and the gate a version-bound workaround checks."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.0.14.dev20260814"`` → ``(0, 0, 14)``.

    Examples:
        >>> version_tuple("0.0.14.dev20260814")
        (0, 0, 14)
    """
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def torchax_version() -> tuple[int, ...] | None:
    """The installed torchax release, or None if torchax is not installed."""
    try:
        return version_tuple(importlib.metadata.version("torchax"))
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class Gate:
    """One upstream bug: where it is tracked and the last torchax release that has it."""

    bug: str
    last_broken_torchax: tuple[int, ...]

    def applies(self) -> bool:
        """Whether the installed torchax still has the bug."""
        version = torchax_version()
        return version is not None and version <= self.last_broken_torchax
