"""torchax ≤ 0.0.13 names ATen ops torch has since removed: resolve them to inert placeholders while it imports."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch._ops

from torchshard._bridge.versions import Gate

# torchax <= 0.0.13 builds op tables at import time that name ATen ops newer torch removed: torch 2.13
# dropped the named-tensor (Dimname) overloads, 2.14 aten::cholesky, 2.15 aten::qr (its amp cast table).
# Fixed by google/torchax#102, in the 0.0.14 nightlies.
REMOVED_ATEN = Gate("https://github.com/google/torchax/issues/101", (0, 0, 13))
# what this torch may lack that torchax 0.0.13 names: (op, overload or None for the whole op)
_PROBES = (("prod", "dim_Dimname"), ("cholesky", None), ("qr", None))


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


class MissingOp:
    """Inert stand-in for a whole ATen op this torch no longer has: each overload is a `MissingOverload`."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __repr__(self) -> str:
        return f"MissingOp({self.qualname!r})"

    def __getattr__(self, overload: str) -> MissingOverload:
        return MissingOverload(_faking(f"{self.qualname}.{overload}"))

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"{self.qualname} was removed from this torch build")


_faked: list[str] = []


def _faking(qualname: str) -> str:
    """Records that ``qualname`` is being resolved to a placeholder."""
    if qualname not in _faked:
        _faked.append(qualname)
    return qualname


def faked_overloads() -> tuple[str, ...]:
    """Names of the ops and overloads that were resolved to placeholders."""
    return tuple(_faked)


def _torch_has(op: str, overload: str | None) -> bool:
    try:
        packet = getattr(torch.ops.aten, op)
        return overload is None or hasattr(packet, overload)
    except AttributeError:
        return False


def needs_import_shim() -> bool:
    """True when torch lacks an op torchax names and torchax is a release that still names it."""
    return not all(_torch_has(op, overload) for op, overload in _PROBES) and REMOVED_ATEN.applies()


@contextlib.contextmanager
def placeholder_removed_aten() -> Iterator[None]:
    """Inside the block, a missing ATen op or overload resolves to a placeholder instead of raising."""
    packet_getattr = torch._ops.OpOverloadPacket.__getattr__
    namespace_getattr = torch._ops._OpNamespace.__getattr__

    def overload_or_placeholder(packet: torch._ops.OpOverloadPacket, key: str) -> object:
        try:
            return packet_getattr(packet, key)
        except AttributeError:
            if key.startswith("__"):  # protocol probes (copy, pickle) must keep failing
                raise
            return MissingOverload(_faking(f"{packet._qualified_op_name}.{key}"))

    def op_or_placeholder(namespace: torch._ops._OpNamespace, op: str) -> object:
        try:
            return namespace_getattr(namespace, op)
        except AttributeError:
            if op.startswith("__") or namespace.name != "aten":
                raise
            return MissingOp(_faking(f"aten::{op}"))

    torch._ops.OpOverloadPacket.__getattr__ = overload_or_placeholder  # type: ignore[method-assign,assignment]
    torch._ops._OpNamespace.__getattr__ = op_or_placeholder  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch._ops.OpOverloadPacket.__getattr__ = packet_getattr  # type: ignore[method-assign]
        torch._ops._OpNamespace.__getattr__ = namespace_getattr  # type: ignore[method-assign]


def import_shim() -> contextlib.AbstractContextManager[None]:
    """The context torchax must be imported in: the placeholders if this torch/torchax pair needs them."""
    return placeholder_removed_aten() if needs_import_shim() else contextlib.nullcontext()
