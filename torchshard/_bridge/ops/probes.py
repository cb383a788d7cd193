"""A library kernel's first use on a platform, probed: traced at the call's shapes, then run on a tiny case.

A library kernel can fail where its rules say it should work: cuDNN's flash attention through
``jax.nn.dot_product_attention`` on CUDA 13 (jax#32430), a Pallas kernel on an unexpected GPU.
Before the first step commits to one, `failure` traces it (forward and backward) at the call's own
shapes, then compiles and runs a tiny case of the call's signature (dtype, head dims, mask kind,
causality, grouped heads) on the platform's first device, forward and backward, against a dense
reference. The tiny case runs once per process per (platform, kernel, signature); its verdict is
cached. `kernels.choose` falls back to ``auto``'s choice where a probe fails, with the failure as
the reason ``trainer.kernels`` shows. `probed` is the cache and runner any library kernel's probe shares
(tokamax's ragged dot and its fused loss use it too).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from torchshard._bridge.ops.kernels import Call

logger = logging.getLogger("torchshard")

Form = Callable[..., jax.Array]  # (query, key, value, attn_mask, is_causal, scale) -> out, torch's [b, h, s, d]
Inputs = tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array]  # q, k, v, mask, the output's weight
Signature = tuple[str, int, int, str | None, bool, bool]

SEQUENCE = 128  # the tiny case's queries and keys: a block of every kernel (splash's 128, cuDNN's even masks)
TOLERANCE = {"float32": 2e-2, "bfloat16": 1e-1, "float16": 1e-1}  # loose: it catches garbage, not rounding

_LOCK = threading.Lock()
_VERDICTS: dict[tuple[str, str, Hashable], str | None] = {}  # (platform, kernel, signature) -> why it failed
_TRACED: dict[tuple[str, Hashable], str | None] = {}  # (kernel, the call's shapes) -> why its trace failed


def signature(call: Call) -> Signature:
    """What a tiny case must share with ``call`` to say whether a kernel runs it: dtype, head dims, mask kind,
    causality and grouped heads.

    Examples:
        >>> signature(Call("", (2, 8, 64, 16), (2, 2, 64, 16), (2, 2, 64, 16), np.dtype("float32"), causal=True))
        ('float32', 16, 16, None, True, True)
    """
    return (str(call.dtype), call.query[-1], call.value[-1], call.mask, call.causal, call.query[1] != call.key[1])


def failure(kernel: str, form: Form, call: Call, platform: str, mask_shape: tuple[int, ...] | None) -> str | None:
    """Why ``form`` (the kernel named ``kernel``) fails ``call`` on ``platform``, or None where it passes.

    Args:
        kernel: the kernel's name (the cache's key; `kernels.KERNELS`, or ``tokamax:<implementation>``).
        form: the kernel on torch's layout: ``form(query, key, value, attn_mask, is_causal, scale)``.
        call: the attention call.
        platform: where the step runs; the tiny case runs on its first device.
        mask_shape: the call's mask's shape (None without one).

    Returns:
        What the trace at the call's shapes raised, or what the tiny case raised or got wrong, or None.
    """
    shapes = (dataclasses.replace(call, site=""), mask_shape)
    trace = functools.partial(_traces, form, call, mask_shape)
    tiny = functools.partial(_tiny, form, call)
    return probed(kernel, shapes, trace, signature(call), platform, tiny, TOLERANCE.get(str(call.dtype), 1e-1))


Errors = Callable[[jax.Device], list[float]]  # a tiny case run on a device -> each output's error, relative to scale


def probed(
    kernel: str, shapes: Hashable, trace: Callable[[], None], signature: Hashable, platform: str, tiny: Errors,
    tolerance: float,
) -> str | None:  # fmt: skip
    """Why ``kernel`` fails a call, or None where it passes: ``trace()`` raising at the call's ``shapes``, or the
    tiny case of its ``signature`` raising on ``platform``'s first device or off by more than ``tolerance``.

    Each verdict is cached: the trace per (kernel, shapes), the tiny case per (platform, kernel, signature).

    Examples:
        >>> forget()
        >>> probed("demo", (), lambda: None, ("float32",), "cpu", lambda device: [0.0, 1e-7], 1e-2) is None
        True
        >>> probed("demo", (), lambda: None, ("float32",), "cpu", lambda device: 1 / 0, 1e-2)  # cached: not rerun
        >>> probed("demo", (), lambda: None, ("bfloat16",), "cpu", lambda device: [0.5], 1e-1)
        'a tiny case is off by 0.5 (relative to scale) against its reference (at most 0.1)'
        >>> forget()
    """
    with _LOCK:
        traced = (kernel, shapes)
        if traced not in _TRACED:
            _TRACED[traced] = _traced(trace)
        if _TRACED[traced] is not None:
            return _TRACED[traced]
        verdict = (platform, kernel, signature)
        if verdict not in _VERDICTS:
            _VERDICTS[verdict] = _ran(tiny, platform, tolerance)
            if _VERDICTS[verdict] is not None:
                logger.warning("kernel %s failed its probe on %s: %s", kernel, platform, _VERDICTS[verdict])
        return _VERDICTS[verdict]


def forget() -> None:
    """Drops every cached verdict, so the next use of each kernel is probed again (tests inject failures)."""
    with _LOCK:
        _VERDICTS.clear()
        _TRACED.clear()


def _say(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:200]}"


def _loss(form: Form, mask: jax.Array | None, causal: bool, weight: jax.Array) -> Callable[..., jax.Array]:
    def loss(q, k, v):
        return (form(q, k, v, mask, causal, None).astype(jnp.float32) * weight).sum()

    return loss


def _traces(form: Form, call: Call, mask_shape: tuple[int, ...] | None) -> None:
    """Traces ``form``'s forward and backward at the call's own shapes (where a kernel refuses one, it raises)."""
    q, k, v = (jax.ShapeDtypeStruct(s, call.dtype) for s in (call.query, call.key, call.value))
    mask = None
    if mask_shape is not None:
        mask = jax.ShapeDtypeStruct(mask_shape, jnp.bool_ if call.mask == "bool" else call.dtype)
    weight = jax.ShapeDtypeStruct((*call.query[:3], call.value[-1]), jnp.float32)
    jax.eval_shape(lambda q, k, v, m, w: jax.grad(_loss(form, m, call.causal, w), (0, 1, 2))(q, k, v),
                   q, k, v, mask, weight)  # fmt: skip


def _traced(trace: Callable[[], None]) -> str | None:
    try:
        trace()
    except Exception as err:  # whatever a kernel raises while tracing is its refusal
        return f"tracing it: {_say(err)}"
    return None


def tiny_case(call: Call, device: jax.Device) -> Inputs:
    """A small batch of ``call``'s signature on ``device``: 2 query heads (over 1 KV head where it groups them),
    `SEQUENCE` queries and keys; every row sees its own key."""
    rng = np.random.default_rng(0)
    grouped = call.query[1] != call.key[1]
    shapes = [(1, 2, SEQUENCE, call.query[-1]), (1, 1 if grouped else 2, SEQUENCE, call.query[-1])]
    shapes += [(*shapes[1][:3], call.value[-1]), (1, 2, SEQUENCE, call.value[-1])]
    q, k, v, weight = (rng.standard_normal(s, dtype=np.float32) for s in shapes)
    mask: np.ndarray | None = None
    if call.mask == "bool":
        mask = (rng.random((1, 1, SEQUENCE, SEQUENCE)) < 0.7) | np.eye(SEQUENCE, dtype=bool)
    elif call.mask == "float":
        mask = rng.standard_normal((1, 1, SEQUENCE, SEQUENCE), dtype=np.float32)
    put = lambda x, dtype: jax.device_put(jnp.asarray(x, dtype), device)  # noqa: E731
    placed = None if mask is None else put(mask, jnp.bool_ if call.mask == "bool" else call.dtype)
    return put(q, call.dtype), put(k, call.dtype), put(v, call.dtype), placed, put(weight, jnp.float32)


def run_case(form: Form, inputs: Inputs, causal: bool) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Compiles and runs ``form`` forward and backward on ``inputs``: the probe's runner (tests make it raise)."""
    q, k, v, mask, weight = inputs
    return jax.jit(jax.value_and_grad(_loss(form, mask, causal, weight), (0, 1, 2)))(q, k, v)


def dense(query, key, value, attn_mask, is_causal, scale) -> jax.Array:
    """Plain softmax attention in float32 on torch's layout: the tiny case's reference (every row sees a key)."""
    q, k, v = (x.astype(jnp.float32) for x in (query, key, value))
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = q @ jnp.swapaxes(k, -1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        scores = jnp.where(attn_mask, scores, -jnp.inf) if attn_mask.dtype == jnp.bool_ else scores + attn_mask
    if is_causal:
        scores = jnp.where(jnp.tri(q.shape[2], k.shape[2], dtype=bool), scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1) @ v


def _tiny(form: Form, call: Call, device: jax.Device) -> list[float]:
    """``form``'s errors against dense attention on a tiny case of ``call``'s signature on ``device``."""
    inputs = tiny_case(call, device)
    value, grads = run_case(form, inputs, call.causal)
    want, want_grads = run_case(dense, inputs, call.causal)
    return [error(a, b) for a, b in zip((value, *grads), (want, *want_grads), strict=True)]


def _ran(tiny: Errors, platform: str, tolerance: float) -> str | None:
    """What running ``tiny`` on ``platform``'s first device raises or gets wrong, or None."""
    try:
        # on a thread of its own: it runs now, outside the trace that asked and the mesh that trace is under
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchshard-probe") as pool:
            errors = pool.submit(lambda: tiny(jax.devices(platform)[0])).result()
    except Exception as err:  # a kernel that cannot compile or run the tiny case fails its probe
        return f"running a tiny case: {_say(err)}"
    worst = max(errors)
    if not worst <= tolerance:  # nan included
        return f"a tiny case is off by {worst:.3g} (relative to scale) against its reference (at most {tolerance})"
    return None


def error(got: jax.Array, want: jax.Array) -> float:
    """The largest difference of ``got`` from ``want``, relative to ``want``'s scale (at least 1)."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max()))
