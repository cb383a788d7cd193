"""Version-gated shims for upstream bugs; each names its bug and is deleted once the pinned versions fix it."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import re
from collections.abc import Callable, Iterator

import torch
import torch._ops


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.0.14.dev20260814"`` → ``(0, 0, 14)``."""
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


# torch 2.13 removed the named-tensor (Dimname) ATen overloads; torchax <= 0.0.13 still names them
# in tables built at import time (fixed by google/torchax#102, in the 0.0.14 nightlies).
NAMED_OVERLOADS = Gate("https://github.com/google/torchax/issues/101", (0, 0, 13))
# torchax's native_batch_norm returns the batch statistics but never writes the running ones.
BATCH_NORM_STATS = Gate("https://github.com/google/torchax/issues/22", (0, 0, 13))

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


def _batch_norm_updating_stats(input, weight, bias, running_mean, running_var, training=False, momentum=0.1, eps=1e-5):
    """``aten.native_batch_norm`` in torch ops that, like torch, writes the running stats back."""
    dims = [0, *range(2, input.ndim)]
    shape = [1, -1] + [1] * (input.ndim - 2)
    if training:
        mean = input.mean(dims)
        centred = input - mean.reshape(shape)
        var = (centred * centred).mean(dims)
        if running_mean is not None:
            count = input.numel() // input.shape[1]
            with torch.no_grad():  # torch tracks the unbiased variance in running_var
                running_mean.copy_((1 - momentum) * running_mean + momentum * mean)
                running_var.copy_((1 - momentum) * running_var + momentum * var * count / max(count - 1, 1))
    else:
        mean, var = running_mean, running_var
    rstd = torch.rsqrt(var + eps)
    out = (input - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    if not training:
        mean, rstd = input.new_zeros((0,)), input.new_zeros((0,))
    return out, mean, rstd


def needs_batch_norm_fix() -> bool:
    """True for torchax releases whose batch norm drops the running statistics."""
    return BATCH_NORM_STATS.applies()


def torch_op_fixes() -> dict[object, Callable[..., object]]:
    """torch ops → torch-level replacements for the bugs the installed torchax has."""
    fixes: dict[object, Callable[..., object]] = {}
    if needs_batch_norm_fix():
        fixes[torch.ops.aten.native_batch_norm] = _batch_norm_updating_stats
    return fixes
