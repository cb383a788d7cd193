"""The experts' grouped matmul: ``jax.lax.ragged_dot``, or tokamax's ``ragged_dot`` one implementation at a time.

``attention_kernel="tokamax"`` asks for tokamax's kernels: its attention (`tokamax_attention`) and,
here, its ``ragged_dot`` for every ``_grouped_mm`` of rows grouped by expert (transformers' experts),
in tokamax's own order (Mosaic, Triton, XLA), the first that takes the call and passes its probe
(`probes.probed`). Every other option keeps ``jax.lax.ragged_dot``. A call site's `kernels.Choice`
says which ran and why, and ``trainer.kernels`` shows it beside the attention calls'.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from torchshard._bridge.ops import probes, tokamax_attention
from torchshard._bridge.ops.kernels import Choice, first_taken

# tokamax's own order, fastest first: Pallas Mosaic (GPU: Hopper/Blackwell; TPU), Pallas Triton (GPU), XLA (anywhere)
IMPLEMENTATIONS = ("mosaic", "triton", "xla")
LAX = "ragged_dot"  # jax.lax.ragged_dot: what a grouped matmul gets unless tokamax is asked for
ROWS, GROUPS = 256, (64, 0, 100, 60)  # the tiny case: an empty group, and 32 rows past the last group
TOLERANCE = {"float32": 2e-2, "bfloat16": 1e-1, "float16": 1e-1}  # loose: it catches garbage, not rounding

Dot = Callable[..., jax.Array]  # (lhs [m, k], rhs [g, k, n], group_sizes [g], out dtype) -> [m, n]
Probe = Callable[[str], str | None]  # ``tokamax:<implementation>`` -> why it failed its probe on this call, or None


@dataclasses.dataclass(frozen=True)
class GroupedCall:
    """One grouped matmul of rows grouped by expert, known at trace time: ``[rows, k] × [groups, k, n]``."""

    site: str  # the module that called it (its state_dict prefix), "" at the top level
    rows: int
    groups: int
    k: int
    n: int
    dtype: np.dtype  # the operands'
    out_dtype: np.dtype


def lax_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, dtype: np.dtype) -> jax.Array:
    """``jax.lax.ragged_dot``: rows past the last group are 0."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=dtype)


def tokamax_dot(implementation: str, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, dtype: np.dtype):
    """``tokamax.ragged_dot(implementation=implementation)``, its rows past the last group 0 (as `lax_dot`'s).

    A kernel may leave those rows unwritten; transformers' experts rely on them being inert (its
    sentinel rows past the last expert's are only read by the next grouped matmul, which skips them).

    Examples:
        >>> lhs, rhs = jnp.ones((4, 2)), jnp.ones((2, 2, 3))
        >>> tokamax_dot("xla", lhs, rhs, jnp.array([1, 2]), np.dtype("float32"))[:, 0].tolist()  # doctest: +SKIP
        [2.0, 2.0, 2.0, 0.0]
    """
    import tokamax

    out = tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=dtype, implementation=implementation)
    filled = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(filled[:, None], out, jnp.zeros((), out.dtype))


def form(kernel: str) -> Dot:
    """The grouped matmul of a `Choice`'s kernel: `LAX` or ``tokamax:<implementation>``.

    Examples:
        >>> form("tokamax:xla").args, form(LAX) is lax_dot
        (('xla',), True)
    """
    if kernel.startswith("tokamax:"):
        return functools.partial(tokamax_dot, kernel.removeprefix("tokamax:"))
    return lax_dot


def _problem(implementation: str, platform: str, devices: int) -> str | None:
    """Why tokamax's ``implementation`` cannot take a call, known before tracing it (tokamax says the rest)."""
    if implementation == "xla":
        return None
    if platform not in ("gpu", "tpu"):
        return f"Pallas kernels for GPUs and TPUs; this step runs on {platform}"
    if implementation == "triton" and platform != "gpu":
        return f"a GPU kernel; this step runs on {platform}"
    if devices > 1:
        # a Pallas kernel is one device's program: GSPMD would gather its operands whole
        return f"a mesh of {devices} devices (a Pallas kernel runs per device; torchshard does not shard_map it yet)"
    return None


def choose(requested: str, call: GroupedCall, platform: str, *, devices: int = 1, probe: Probe | None = None) -> Choice:
    """The grouped matmul ``call`` gets when ``attention_kernel=requested``, on ``platform`` and a mesh of ``devices``.

    Args:
        requested: the ``attention_kernel`` option: ``"tokamax"`` asks for tokamax's ``ragged_dot``; any
            other keeps `LAX`.
        call: the grouped matmul.
        platform: where the step runs.
        devices: the mesh's size.
        probe: why ``tokamax:<implementation>`` failed its probe on this call, or None where it passed
            (`failure`); by default every implementation passes.

    Examples:
        >>> call = GroupedCall("model.layers.0.mlp.experts", 512, 8, 64, 128, np.dtype("float32"), np.dtype("float32"))
        >>> str(choose("auto", call, "gpu"))
        'ragged_dot'
    """
    if requested != "tokamax":
        return Choice(LAX, "")
    if (missing := tokamax_attention.missing()) is not None:
        return Choice(LAX, missing)
    probe = probe or (lambda kernel: None)
    found = first_taken(IMPLEMENTATIONS, lambda implementation: _problem(implementation, platform, devices), probe)
    return found if isinstance(found, Choice) else Choice(LAX, found)


def signature(call: GroupedCall) -> tuple[str, str, int, int]:
    """What a tiny case must share with ``call`` to say whether a kernel runs it: dtypes and the matrices' widths."""
    return (str(call.dtype), str(call.out_dtype), call.k, call.n)


def failure(kernel: str, *, call: GroupedCall, platform: str) -> str | None:
    """Why ``kernel`` (``tokamax:<implementation>``) fails ``call`` on ``platform``, or None where it passes.

    Its forward and backward are traced at the call's shapes, then a tiny case of its `signature`
    (`ROWS` rows in `GROUPS`, one group empty and rows past the last) runs on the platform's first
    device against ``jax.lax.ragged_dot``, values and gradients (`probes.probed`).
    """
    dot = form(kernel)
    trace = functools.partial(_traces, dot, call)
    tiny = functools.partial(_tiny, dot, call)
    shapes = dataclasses.replace(call, site="")
    return probes.probed(kernel, shapes, trace, signature(call), platform, tiny, TOLERANCE.get(str(call.dtype), 1e-1))


def _loss(dot: Dot, group_sizes: jax.Array, dtype: np.dtype, weight: jax.Array) -> Callable[..., jax.Array]:
    def loss(lhs, rhs):
        return (dot(lhs, rhs, group_sizes, dtype).astype(jnp.float32) * weight).sum()

    return loss


def _traces(dot: Dot, call: GroupedCall) -> None:
    """Traces ``dot``'s forward and backward at the call's own shapes (an implementation that refuses one raises)."""
    lhs = jax.ShapeDtypeStruct((call.rows, call.k), call.dtype)
    rhs = jax.ShapeDtypeStruct((call.groups, call.k, call.n), call.dtype)
    sizes = jax.ShapeDtypeStruct((call.groups,), jnp.int32)
    weight = jax.ShapeDtypeStruct((call.rows, call.n), jnp.float32)
    jax.eval_shape(lambda a, b, g, w: jax.grad(_loss(dot, g, call.out_dtype, w), (0, 1))(a, b), lhs, rhs, sizes, weight)


Inputs = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # lhs, rhs, group sizes, the output's weight


def tiny_case(call: GroupedCall, device: jax.Device) -> Inputs:
    """`ROWS` rows of ``call``'s widths and dtype in `GROUPS`, on ``device``."""
    rng = np.random.default_rng(0)
    shapes = [(ROWS, call.k), (len(GROUPS), call.k, call.n), (ROWS, call.n)]
    lhs, rhs, weight = (rng.standard_normal(s, dtype=np.float32) for s in shapes)
    put = lambda x, dtype: jax.device_put(jnp.asarray(x, dtype), device)  # noqa: E731
    rhs = rhs / np.sqrt(call.k)
    return put(lhs, call.dtype), put(rhs, call.dtype), put(np.array(GROUPS), jnp.int32), put(weight, jnp.float32)


def run_case(dot: Dot, inputs: Inputs, dtype: np.dtype) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Compiles and runs ``dot`` forward and backward on ``inputs``: the probe's runner (tests make it raise)."""
    lhs, rhs, group_sizes, weight = inputs
    return jax.jit(jax.value_and_grad(_loss(dot, group_sizes, dtype, weight), (0, 1)))(lhs, rhs)


def _tiny(dot: Dot, call: GroupedCall, device: jax.Device) -> list[float]:
    inputs = tiny_case(call, device)
    value, grads = run_case(dot, inputs, call.out_dtype)
    want, want_grads = run_case(lax_dot, inputs, call.out_dtype)
    return [probes.error(a, b) for a, b in zip((value, *grads), (want, *want_grads), strict=True)]
