"""torch ops of mixture-of-experts layers lowered to JAX (transformers' grouped_mm experts).

Rows grouped by expert take the grouped matmul `tokamax_ragged.choose` picks (``jax.lax.ragged_dot``,
or tokamax's ``ragged_dot`` under ``attention_kernel="tokamax"``), recorded by call site.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchshard._bridge.loaded import Environment
from torchshard._bridge.ops import kernels, tokamax_ragged
from torchshard._bridge.registry import register
from torchshard._bridge.scopes import current_module


def _group_sizes(offs: jax.Array) -> jax.Array:
    """Cumulative end offsets ``[e_0, e_1, ...]`` → group sizes ``[e_0, e_1 - e_0, ...]``."""
    offs = offs.astype(jnp.int32)  # torch requires int32; an int64 tensor is held as int32 anyway
    return jnp.diff(offs, prepend=jnp.zeros((1,), jnp.int32))


def _group_mask(offs: jax.Array, length: int) -> jax.Array:
    """``[groups, length]``: True where position ``i`` lies in group ``g`` (``offs[g-1] <= i < offs[g]``)."""
    offs = offs.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), offs[:-1]])
    i = jnp.arange(length)
    return (i[None, :] >= starts[:, None]) & (i[None, :] < offs[:, None])


def _out_dtype(out_dtype: Any, like: jax.Array) -> np.dtype:
    if out_dtype is None:
        return np.dtype(like.dtype)
    # torch's float dtypes share their names with JAX's (torch.bfloat16 → jnp.bfloat16)
    return np.dtype(jnp.dtype(str(out_dtype).removeprefix("torch.")))


def _ragged(lhs: jax.Array, rhs: jax.Array, offs: jax.Array, dtype: np.dtype) -> jax.Array:
    """``[m, k] × [g, k, n]`` by groups of rows, through the kernel the trace's policy picks (recorded there)."""
    policy = kernels.current(jax.default_backend())
    call = tokamax_ragged.GroupedCall(
        current_module(), lhs.shape[0], rhs.shape[0], lhs.shape[1], rhs.shape[2], np.dtype(lhs.dtype), dtype
    )
    probe = functools.partial(tokamax_ragged.failure, call=call, platform=policy.platform)
    choice = tokamax_ragged.choose(policy.requested, call, policy.platform, devices=policy.devices, probe=probe)
    if policy.record is not None:
        policy.record.setdefault(call.site, choice)
    return tokamax_ragged.form(choice.kernel)(lhs, rhs, _group_sizes(offs), dtype)


def _form_problem(a: jax.Array, b: jax.Array, offs: jax.Array | None) -> str | None:
    if a.ndim not in (2, 3) or b.ndim not in (2, 3):
        return f"operands must be 2-D or 3-D, got {a.ndim}-D × {b.ndim}-D"
    if (offs is None) != (a.ndim == 3 and b.ndim == 3):
        return "offs is required when an operand is 2-D and not allowed when both are 3-D"
    if offs is not None and (offs.ndim != 1 or not jnp.issubdtype(offs.dtype, jnp.integer)):
        return f"offs must be a 1-D integer tensor (torch: int32), got {offs.dtype} of shape {offs.shape}"
    return None


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``aten._grouped_mm``: one matrix product per group of rows, columns or batch entries.

    The forms torch defines (``offs`` holds cumulative *end* offsets, ``offs[-1]`` of the grouped dim):

    * 2-D × 3-D, ``a [M, K]``, ``b [G, K, N]``: rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]`` →
      ``[M, N]`` (transformers' experts: tokens sorted by expert). ``jax.lax.ragged_dot``, or tokamax's
      ``ragged_dot`` under ``attention_kernel="tokamax"`` (`tokamax_ragged`).
    * 3-D × 2-D, ``a [G, M, K]``, ``b [K, N]``: ``a[g]`` times columns ``offs[g-1]:offs[g]`` → ``[M, N]``.
    * 2-D × 2-D, ``a [M, K]``, ``b [K, N]``: the product over ``K`` slice ``g`` → ``[G, M, N]``.
    * 3-D × 3-D without ``offs``: a batched product ``[G, M, N]``.

    Gradients come from JAX's autodiff of these, not from torch's backward. Rows (columns) at or
    beyond ``offs[-1]`` are 0 here, and their gradient too; torch leaves them uninitialised, so no
    caller may read them (transformers masks them). ``bias`` is refused, as torch refuses it.
    """
    problem = _form_problem(mat_a, mat_b, offs)
    if problem is None and bias is not None:
        problem = "bias is not supported (torch refuses it too); add the bias to the result"
    if problem is not None:
        raise ValueError(f"_grouped_mm({mat_a.shape} × {mat_b.shape}): {problem}")
    dtype = _out_dtype(out_dtype, mat_a)
    if offs is None:
        return jnp.matmul(mat_a, mat_b, preferred_element_type=dtype).astype(dtype)
    if mat_a.ndim == 2 and mat_b.ndim == 3:
        out = _ragged(mat_a, mat_b, offs, dtype)
    elif mat_a.ndim == 3 and mat_b.ndim == 2:
        # the transpose of the 2-D × 3-D form: columns of b are the ragged rows of b.T
        out = _ragged(mat_b.T, jnp.swapaxes(mat_a, 1, 2), offs, dtype).T
    else:
        # ragged contracting dim: JAX's ragged_dot_general has no gradient for it, a masked einsum has
        mask = _group_mask(offs, mat_a.shape[1]).astype(mat_a.dtype)
        out = jnp.einsum("mk,gk,kn->gmn", mat_a, mask, mat_b, preferred_element_type=dtype)
    return out.astype(dtype)


def install(tx: Environment) -> None:
    """Registers the lowering in ``tx``."""
    for op in (torch.ops.aten._grouped_mm, torch.ops.aten._grouped_mm.default):
        register(tx, op, grouped_mm, jax_function=True, needs_env=False)
