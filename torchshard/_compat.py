"""Compatibility shims that let torchax 0.0.13 import on torch builds without named-tensor overloads."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import re
from collections.abc import Iterator

import torch
import torch._ops

# torch 2.13 removed the named-tensor (Dimname) ATen overloads; torchax <= 0.0.13 still
# names them in tables built at import time. Only these names may be faked.
_NAMED_OVERLOAD = re.compile(r"(?i).*(dimname|names).*")
_LAST_BROKEN_TORCHAX = (0, 0, 13)


class MissingOverload:
    """Inert stand-in for an ATen overload that this torch build no longer has.

    It is hashable and is not a `torch._ops.OperatorBase`, so torchax's op tables and
    `torch._decomp.get_decompositions` keep it without ever dispatching to it.
    """

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __repr__(self) -> str:
        return f"MissingOverload({self.qualname!r})"

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"{self.qualname} was removed from this torch build")


_faked: list[str] = []


def faked_overloads() -> tuple[str, ...]:
    """Names of the overloads that were resolved to `MissingOverload` placeholders."""
    return tuple(_faked)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def needs_named_overload_shim() -> bool:
    """True when torch lacks the named overloads and torchax is a release that still uses them."""
    torch_has_them = hasattr(torch.ops.aten.prod, "dim_Dimname")
    try:
        torchax_version = _version_tuple(importlib.metadata.version("torchax"))
    except importlib.metadata.PackageNotFoundError:
        return False
    return not torch_has_them and torchax_version <= _LAST_BROKEN_TORCHAX


@contextlib.contextmanager
def _placeholder_named_overloads() -> Iterator[None]:
    original = torch._ops.OpOverloadPacket.__getattr__

    def getattr_or_placeholder(packet: torch._ops.OpOverloadPacket, key: str) -> object:
        try:
            return original(packet, key)
        except AttributeError:
            if not _NAMED_OVERLOAD.fullmatch(key):
                raise
            qualname = f"{packet._qualified_op_name}.{key}"
            _faked.append(qualname)
            return MissingOverload(qualname)

    torch._ops.OpOverloadPacket.__getattr__ = getattr_or_placeholder
    try:
        yield
    finally:
        torch._ops.OpOverloadPacket.__getattr__ = original


def import_torchax() -> None:
    """Imports torchax and the modules it loads lazily, with the shim only if this pair needs it.

    `torchax.decompositions` is normally imported when the first environment is created;
    importing it here keeps the shim's window closed afterwards and creates no environment
    (which would initialise the JAX backend).
    """
    shim = _placeholder_named_overloads() if needs_named_overload_shim() else contextlib.nullcontext()
    with shim:
        for name in ("torchax", "torchax.decompositions", "torchax.amp", "torchax.interop"):
            importlib.import_module(name)
