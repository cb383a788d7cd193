"""torchax ≤ 0.0.13 names ATen overloads torch removed: resolve them to inert placeholders while it imports."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
import torch._ops

from torchshard._bridge.versions import Gate

# torch 2.13 removed the named-tensor (Dimname) ATen overloads; torchax <= 0.0.13 still names them
# in tables built at import time (fixed by google/torchax#102, in the 0.0.14 nightlies).
NAMED_OVERLOADS = Gate("https://github.com/google/torchax/issues/101", (0, 0, 13))

_NAMED_OVERLOAD = re.compile(r"(?i).*(dimname|names).*")  # only these overload names may be faked


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


def needs_named_overload_shim() -> bool:
    """True when torch lacks the named overloads and torchax is a release that still uses them."""
    return not hasattr(torch.ops.aten.prod, "dim_Dimname") and NAMED_OVERLOADS.applies()


@contextlib.contextmanager
def placeholder_named_overloads() -> Iterator[None]:
    """Inside the block, a missing named overload resolves to a `MissingOverload` instead of raising."""
    original = torch._ops.OpOverloadPacket.__getattr__

    def getattr_or_placeholder(packet: torch._ops.OpOverloadPacket, key: str) -> object:
        try:
            return original(packet, key)
        except AttributeError:
            if not _NAMED_OVERLOAD.fullmatch(key):
                raise
            qualname = f"{packet._qualified_op_name}.{key}"
            if qualname not in _faked:
                _faked.append(qualname)
            return MissingOverload(qualname)

    torch._ops.OpOverloadPacket.__getattr__ = getattr_or_placeholder  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch._ops.OpOverloadPacket.__getattr__ = original  # type: ignore[method-assign]


def import_shim() -> contextlib.AbstractContextManager[None]:
    """The context torchax must be imported in: the named-overload placeholders if this pair needs them."""
    return placeholder_named_overloads() if needs_named_overload_shim() else contextlib.nullcontext()
