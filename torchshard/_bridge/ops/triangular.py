"""Triangular solves on CPU as blocked substitution: matmuls and slices, no LAPACK call.

The gated delta-rule mixers (qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid) solve a unit lower
triangular system per chunk with ``torch.linalg.solve_triangular``. On CPU, JAX runs it as LAPACK's
``trsm`` through an FFI handler that splits its batch over XLA's intra-op thread pool and waits
for the pieces. The simulated devices run their programs on that same pool, so when every device
enters the solve at once each pool thread waits for pieces queued behind the others: the step
never finishes (gdb: all eight ``tf_XLAEigen`` threads in ``jax::ParallelBatchMap`` waiting).
Substitution by halves (solve the top half, subtract it from the bottom, solve the bottom half)
is the same arithmetic as matmuls, and autodiff differentiates it. GPU and TPU keep the native
solve (``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchshard._bridge.loaded import Environment
from torchshard._bridge.registry import register

LEAF = 8  # rows solved one by one; larger systems split in halves


def lower_solve(a: jax.Array, b: jax.Array, *, unit: bool) -> jax.Array:
    """``x`` with ``tril(a) @ x == b`` (batch dims broadcast), the diagonal taken as ones if ``unit``.

    Examples:
        >>> a = jnp.array([[2.0, 0.0], [1.0, 4.0]])
        >>> lower_solve(a, jnp.array([[2.0], [9.0]]), unit=False).tolist()
        [[1.0], [2.0]]
    """
    n = a.shape[-1]
    if n <= LEAF:
        rows: list[jax.Array] = []
        for i in range(n):
            row = b[..., i, :]
            if rows:
                row = row - jnp.einsum("...j,...jk->...k", a[..., i, :i], jnp.stack(rows, -2))
            rows.append(row if unit else row / a[..., i, i, None])
        return jnp.stack(rows, -2)
    h = n // 2
    top = lower_solve(a[..., :h, :h], b[..., :h, :], unit=unit)
    rest = b[..., h:, :] - jnp.matmul(a[..., h:, :h], top)
    return jnp.concatenate([top, lower_solve(a[..., h:, h:], rest, unit=unit)], -2)


def _native(a: jax.Array, b: jax.Array, *, lower: bool, unit: bool) -> jax.Array:
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])
    return jax.scipy.linalg.solve_triangular(a, b, lower=lower, unit_diagonal=unit)


def _substituted(a: jax.Array, b: jax.Array, *, lower: bool, unit: bool) -> jax.Array:
    if lower:
        return lower_solve(a, b, unit=unit)
    # an upper system is a lower one with rows and columns in reverse order
    return lower_solve(a[..., ::-1, ::-1], b[..., ::-1, :], unit=unit)[..., ::-1, :]


def solve_triangular(
    a: jax.Array, b: jax.Array, *, upper: bool = True, left: bool = True, unitriangular: bool = False
) -> jax.Array:
    """``aten.linalg_solve_triangular``: substitution on CPU, the native solve elsewhere."""
    if not left:  # x @ a = b  <=>  a.T @ x.T = b.T
        a, b, upper = jnp.matrix_transpose(a), jnp.matrix_transpose(b), not upper
    dtype = jnp.result_type(a, b)
    a, b = a.astype(dtype), b.astype(dtype)
    x = jax.lax.platform_dependent(
        a,
        b,
        cpu=lambda a, b: _substituted(a, b, lower=not upper, unit=unitriangular),
        default=lambda a, b: _native(a, b, lower=not upper, unit=unitriangular),
    )
    return x if left else jnp.matrix_transpose(x)


def install(tx: Environment) -> None:
    """Registers the lowering in ``tx``."""
    register(tx, torch.ops.aten.linalg_solve_triangular, solve_triangular, jax_function=True, needs_env=False)
