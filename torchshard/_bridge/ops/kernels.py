"""Which kernel each attention call gets: chosen at trace time from the call's shapes, dtype, mask and platform.

``auto`` takes cuDNN's fused flash attention on a GPU where it takes the call, Pallas' splash
attention on a TPU where it applies, and torchshard's tiled online-softmax kernel everywhere else
(the CPU always). ``cudnn``, ``splash``, ``xla`` (``jax.nn.dot_product_attention``'s XLA
implementation) and ``tiled`` force one: a forced kernel that cannot take a call is an
`ArgumentError` naming the call and why. A `Policy` set for a trace (`choosing`) says what was asked
and collects each call site's `Choice`, which ``trainer.kernels`` shows.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, MutableMapping

import jax.numpy as jnp
import numpy as np

from torchshard._base.errors import ArgumentError

KERNELS = ("auto", "cudnn", "splash", "xla", "tiled")
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
SPLASH_BLOCK = 128  # splash attention's default query/key block: sequences must be multiples of it


@dataclasses.dataclass(frozen=True)
class Call:
    """What one ``scaled_dot_product_attention`` call asks for, known at trace time (torch's [b, heads, s, d])."""

    site: str  # the module that called it (its state_dict prefix), "" at the top level
    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: np.dtype
    mask: str | None = None  # "bool", "float", or None
    causal: bool = False
    dropout: bool = False


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel one call site got, and why (what ruled out the kernels ``auto`` prefers)."""

    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel} ({self.reason})" if self.reason else self.kernel


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a trace asked for: the kernel (or ``auto``), the platform it runs on, and where choices are recorded."""

    requested: str = "auto"
    platform: str = "cpu"
    devices: int = 1  # the mesh's: splash runs per device, so only a one-device step may call it under GSPMD
    record: MutableMapping[str, Choice] | None = None


_POLICY: contextvars.ContextVar[Policy | None] = contextvars.ContextVar("torchshard_attention_policy", default=None)


@contextlib.contextmanager
def choosing(policy: Policy) -> Iterator[None]:
    """Inside the block, attention calls choose their kernel by ``policy`` and record it there."""
    token = _POLICY.set(policy)
    try:
        yield
    finally:
        _POLICY.reset(token)


def current(platform: str) -> Policy:
    """The policy of the trace in progress, else ``auto`` on ``platform`` (a forward outside any Trainer)."""
    return _POLICY.get() or Policy(platform=platform)


def check_kernel(kernel: object, *, what: str) -> list[str]:
    """Why ``kernel`` is not a kernel name (``what`` names the argument), or nothing.

    Examples:
        >>> check_kernel("flash", what="Trainer(attention_kernel=)")
        ["Trainer(attention_kernel=) must be one of 'auto', 'cudnn', 'splash', 'xla', 'tiled', got 'flash'"]
    """
    if isinstance(kernel, str) and kernel in KERNELS:
        return []
    names = ", ".join(repr(k) for k in KERNELS)
    return [f"{what} must be one of {names}, got {kernel!r:.40}"]


def _xla_problem(call: Call) -> str | None:
    """Why ``jax.nn.dot_product_attention`` cannot take the call (its XLA and cuDNN forms share these limits)."""
    if call.dropout:
        return "dropout: only torchax's reference attention draws its mask"
    if call.value[-1] != call.query[-1]:
        return f"values of head dim {call.value[-1]} against queries' {call.query[-1]} (MLA): it needs them equal"
    if call.query[1] % call.key[1]:
        return f"{call.query[1]} query heads over {call.key[1]} key heads"
    return None


def _cudnn_problem(call: Call, platform: str) -> str | None:
    if platform != "gpu":
        return f"cuDNN runs on GPUs; this step runs on {platform}"
    if (problem := _xla_problem(call)) is not None:
        return problem
    if call.dtype not in CUDNN_DTYPES:
        return f"{call.dtype} inputs (cuDNN's flash attention takes bf16/fp16: use MixedPrecision)"
    if call.query[-1] > 128 or call.query[-1] % 8:
        # 256 needs Hopper; the device's compute capability is not known while tracing, so 128 is the safe bound
        return f"head dim {call.query[-1]} (cuDNN: a multiple of 8, at most 128)"
    if call.causal and call.query[2] != call.key[2]:
        return f"a causal mask over {call.query[2]} queries and {call.key[2]} keys (torch's top-left alignment)"
    if call.mask is not None and (call.query[2] % 2 or call.key[2] % 2):
        return "a mask over an odd sequence length"
    return None


def _splash_problem(call: Call, platform: str, devices: int) -> str | None:
    if platform != "tpu":
        return f"splash attention runs on TPUs; this step runs on {platform}"
    if devices > 1:
        # a Pallas kernel is one device's program: GSPMD cannot split it, and would gather its operands whole
        return f"a mesh of {devices} devices (splash runs per device; torchshard does not shard_map it yet)"
    if (problem := _xla_problem(call)) is not None:
        return problem
    if call.mask is not None:
        return "an attention mask tensor (splash takes causal or no mask)"
    if call.query[2] % SPLASH_BLOCK or call.key[2] % SPLASH_BLOCK:
        return f"sequences of {call.query[2]} and {call.key[2]} (splash: multiples of {SPLASH_BLOCK})"
    if call.causal and call.query[2] != call.key[2]:
        return f"a causal mask over {call.query[2]} queries and {call.key[2]} keys"
    return None


def _problem(kernel: str, call: Call, platform: str, devices: int) -> str | None:
    if kernel == "cudnn":
        return _cudnn_problem(call, platform)
    if kernel == "splash":
        return _splash_problem(call, platform, devices)
    if kernel == "xla":
        return _xla_problem(call)
    return "dropout: only torchax's reference attention draws its mask" if call.dropout else None


def choose(requested: str, call: Call, platform: str, *, devices: int = 1) -> Choice:
    """The kernel ``call`` gets when ``requested`` (a name of `KERNELS`) on ``platform``, on a mesh of ``devices``.

    Raises:
        ArgumentError: a forced kernel that cannot take the call, naming the call site and why.

    Examples:
        >>> call = Call("model.layers.0.self_attn", (2, 8, 256, 64), (2, 2, 256, 64), (2, 2, 256, 64),
        ...             np.dtype(jnp.bfloat16), causal=True)
        >>> str(choose("auto", call, "gpu"))
        'cudnn'
        >>> str(choose("auto", call, "cpu"))
        'tiled (cpu: no fused attention kernel there)'
        >>> str(choose("auto", call, "tpu", devices=8))
        'tiled (a mesh of 8 devices (splash runs per device; torchshard does not shard_map it yet))'
    """
    if requested != "auto":
        if (problem := _problem(requested, call, platform, devices)) is not None:
            where = call.site or "the top level"
            raise ArgumentError(
                f"attention_kernel={requested!r} cannot take the attention called by {where} "
                f"(query {list(call.query)}, key {list(call.key)}, value {list(call.value)}, {call.dtype}): "
                f"{problem}; use attention_kernel='auto' to fall back where a kernel cannot"
            )
        return Choice(requested, "forced")
    if platform not in ("gpu", "tpu"):
        return Choice("reference" if call.dropout else "tiled", f"{platform}: no fused attention kernel there")
    preferred = "splash" if platform == "tpu" else "cudnn"
    problem = _problem(preferred, call, platform, devices)
    if problem is None:
        return Choice(preferred, "")
    if call.dropout:
        return Choice("reference", problem)
    return Choice("tiled", problem)
