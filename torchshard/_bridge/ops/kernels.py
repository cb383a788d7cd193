"""Which kernel each attention call gets: chosen at trace time from the call's shapes, dtype, mask and platform.

``auto`` takes cuDNN's fused flash attention on a GPU where it takes the call, Pallas' splash
attention on a TPU where it applies, and torchshard's tiled online-softmax kernel everywhere else
(the CPU always). ``cudnn``, ``splash``, ``xla`` (``jax.nn.dot_product_attention``'s XLA
implementation) and ``tiled`` force one: a forced kernel that cannot take a call is an
`ArgumentError` naming the call and why. ``tokamax`` takes tokamax's ``dot_product_attention`` in its
own order of implementations (`tokamax_attention.IMPLEMENTATIONS`), the first that takes the call.
A library kernel (`PROBED`) is probed on its first use (`probes.failure`, passed in as ``probe``);
one that fails its probe falls back to ``auto``'s choice, with the failure as the reason. A `Policy`
set for a trace (`choosing`) says what was asked and collects each call site's `Choice`, which
``trainer.kernels`` shows.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, MutableMapping, Sequence

import jax.numpy as jnp
import numpy as np

from torchshard._base.errors import ArgumentError
from torchshard._bridge.ops import tokamax_attention

KERNELS = ("auto", "cudnn", "splash", "xla", "tiled", "tokamax")
PROBED = ("cudnn", "splash", "xla")  # library kernels, and each of tokamax's implementations ("tokamax:xla")
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
DROPOUT = "dropout: only torchax's reference attention draws its mask"
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

    kernel: str  # a name of KERNELS, "reference", "ring", or "tokamax:<implementation>" (the one that ran)
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
        ["Trainer(attention_kernel=) must be one of 'auto', 'cudnn', 'splash', 'xla', 'tiled', 'tokamax', got 'flash'"]
    """
    if isinstance(kernel, str) and kernel in KERNELS:
        # a package missing here is refused up front, not probed: no step could ever run it
        missing = tokamax_attention.missing() if kernel == "tokamax" else None
        return [] if missing is None else [f"{what}='tokamax' cannot run here: {missing}"]
    names = ", ".join(repr(k) for k in KERNELS)
    return [f"{what} must be one of {names}, got {kernel!r:.40}"]


def _xla_problem(call: Call) -> str | None:
    """Why ``jax.nn.dot_product_attention`` cannot take the call (its XLA and cuDNN forms share these limits)."""
    if call.dropout:
        return DROPOUT
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
    return DROPOUT if call.dropout else None


Probe = Callable[[str], str | None]  # a kernel's name -> why it failed its probe on this call, or None


def _tokamax_problem(implementation: str, call: Call, platform: str, devices: int) -> str | None:
    """Why tokamax's ``implementation`` cannot take the call, known before tracing it (tokamax says the rest)."""
    if implementation == "xla":
        return None
    if platform != "gpu":
        return f"GPU kernels; this step runs on {platform}"
    if implementation == "cudnn":
        return _cudnn_problem(call, platform)
    if devices > 1:
        # a Pallas kernel is one device's program, as splash is: GSPMD would gather its operands whole
        return f"a mesh of {devices} devices (a Pallas kernel runs per device; torchshard does not shard_map it yet)"
    return None


def _refuse(requested: str, call: Call, problem: str) -> ArgumentError:
    where = call.site or "the top level"
    return ArgumentError(
        f"attention_kernel={requested!r} cannot take the attention called by {where} "
        f"(query {list(call.query)}, key {list(call.key)}, value {list(call.value)}, {call.dtype}): "
        f"{problem}; use attention_kernel='auto' to fall back where a kernel cannot"
    )


def _passed(kernel: str) -> str | None:
    return None


def _auto(call: Call, platform: str, devices: int, probe: Probe) -> Choice:
    if platform not in ("gpu", "tpu"):
        return Choice("reference" if call.dropout else "tiled", f"{platform}: no fused attention kernel there")
    preferred = "splash" if platform == "tpu" else "cudnn"
    problem = _problem(preferred, call, platform, devices)
    if problem is None and (failure := probe(preferred)) is not None:
        problem = f"{preferred} failed its probe ({failure})"
    if problem is None:
        return Choice(preferred, "")
    return Choice("reference" if call.dropout else "tiled", problem)


def _fallback(why: str, call: Call, platform: str, devices: int, probe: Probe) -> Choice:
    """``auto``'s choice for a call the forced kernel failed, saying why first."""
    auto = _auto(call, platform, devices, probe)
    return Choice(auto.kernel, why if auto.reason in ("", why) else f"{why}; {auto.reason}")


def _tokamax(call: Call, platform: str, devices: int, probe: Probe) -> Choice:
    """tokamax's first implementation, in its own order, that takes the call and passes its probe."""
    if (problem := tokamax_attention.missing() or (DROPOUT if call.dropout else None)) is not None:
        raise _refuse("tokamax", call, problem)
    implementations = tokamax_attention.IMPLEMENTATIONS
    found = first_taken(implementations, lambda i: _tokamax_problem(i, call, platform, devices), probe)
    return found if isinstance(found, Choice) else _fallback(found, call, platform, devices, probe)


def first_taken(implementations: Sequence[str], problem: Callable[[str], str | None], probe: Probe) -> Choice | str:
    """tokamax's first implementation, in order, that takes the call (``problem`` says why not) and passes its
    probe; else why none did, as ``"tokamax: mosaic, triton: GPU kernels; ..."``.

    Examples:
        >>> first_taken(("mosaic", "xla"), lambda i: "a GPU kernel" if i == "mosaic" else None, lambda k: None)
        Choice(kernel='tokamax:xla', reason='forced; mosaic: a GPU kernel')
    """
    skipped: dict[str, list[str]] = {}  # why -> the implementations skipped for it, in order
    for implementation in implementations:
        why = problem(implementation)
        if why is None and (failure := probe(f"tokamax:{implementation}")) is not None:
            why = f"failed its probe ({failure})"
        if why is None:
            return Choice(f"tokamax:{implementation}", "; ".join(["forced", *said(skipped)]))
        skipped.setdefault(why, []).append(implementation)
    return "tokamax: " + "; ".join(said(skipped))


def said(skipped: dict[str, list[str]]) -> list[str]:
    """Each reason, after the implementations it skipped: ``["mosaic, triton: GPU kernels; ..."]``.

    Examples:
        >>> said({"GPU kernels": ["mosaic", "triton"]})
        ['mosaic, triton: GPU kernels']
    """
    return [f"{', '.join(names)}: {why}" for why, names in skipped.items()]


def choose(requested: str, call: Call, platform: str, *, devices: int = 1, probe: Probe | None = None) -> Choice:
    """The kernel ``call`` gets when ``requested`` (a name of `KERNELS`) on ``platform``, on a mesh of ``devices``.

    Args:
        requested: a name of `KERNELS`.
        call: the attention call.
        platform: where the step runs.
        devices: the mesh's size.
        probe: why a kernel (a name of `PROBED`, or ``tokamax:<implementation>``) failed its probe on this
            call, or None where it passed (`probes.failure`); by default every kernel passes.

    Raises:
        ArgumentError: a forced kernel that cannot take the call, naming the call site and why.

    Examples:
        >>> call = Call("model.layers.0.self_attn", (2, 8, 256, 64), (2, 2, 256, 64), (2, 2, 256, 64),
        ...             np.dtype(jnp.bfloat16), causal=True)
        >>> str(choose("auto", call, "gpu"))
        'cudnn'
        >>> str(choose("auto", call, "gpu", probe=lambda kernel: "RuntimeError: no cuDNN"))
        'tiled (cudnn failed its probe (RuntimeError: no cuDNN))'
        >>> str(choose("auto", call, "cpu"))
        'tiled (cpu: no fused attention kernel there)'
        >>> str(choose("auto", call, "tpu", devices=8))
        'tiled (a mesh of 8 devices (splash runs per device; torchshard does not shard_map it yet))'
    """
    probe = probe or _passed
    if requested == "auto":
        return _auto(call, platform, devices, probe)
    if requested == "tokamax":
        return _tokamax(call, platform, devices, probe)
    if (problem := _problem(requested, call, platform, devices)) is not None:
        raise _refuse(requested, call, problem)
    if requested in PROBED and (failure := probe(requested)) is not None:
        return _fallback(f"{requested} failed its probe ({failure})", call, platform, devices, probe)
    return Choice(requested, "forced")
