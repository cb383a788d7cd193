"""torchax's environment with torchshard's lowerings installed, its RNG key, and whether JAX has started."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import torch

from torchshard._bridge import autocast, grad_mode, init_ops, xla_flags
from torchshard._bridge.fixes import (
    batch_norm_stats,
    captured_constants,
    copy_from_views,
    narrow_dtypes,
    ragged_dot_dims,
)
from torchshard._bridge.loaded import Environment, torchax
from torchshard._bridge.ops import (
    asserts,
    attention,
    conv,
    cross_entropy,
    embedding,
    gather,
    grouped_mm,
    linear,
    same_dtype,
    tensor_set,
    triangular,
)
from torchshard._bridge.registry import register

_fixed_envs: set[int] = set()


def env() -> Environment:
    """torchax's default environment with torchshard's lowerings, created on first use (starts the JAX backend)."""
    xla_flags.apply_gpu_flags(started=backend_started())  # before torchax's environment starts the backend
    # torchax makes each thread's first RNG key when that thread first reads the environment's properties; made
    # inside a trace (jax >= 0.11 stages even a constant key), it would be that trace's tracer, left as the key
    with jax.ensure_compile_time_eval():
        tx = torchax.default_env()
        tx.param  # noqa: B018  # this thread's key, made now
    if id(tx) not in _fixed_envs:
        _install_lowerings(tx)
        _fixed_envs.add(id(tx))
    return tx


def _install_lowerings(tx: Environment) -> None:
    # one line per file: deleting a workaround deletes its file and its line here
    autocast.install(tx)
    grad_mode.install(tx)
    batch_norm_stats.install(tx)  # google/torchax#22
    narrow_dtypes.install(tx)
    captured_constants.install(tx)
    copy_from_views.install(tx)  # torchax's copy_ reads a view's missing _elem
    init_ops.install(tx)
    gather.install(tx)
    embedding.install(tx)
    linear.install(tx)
    grouped_mm.install(tx)
    ragged_dot_dims.install()  # JAX's CPU decomposition of a vmapped ragged_dot
    attention.install(tx)
    conv.install(tx)
    triangular.install(tx)  # LAPACK's trsm deadlocks the simulated CPU devices
    cross_entropy.install(tx)
    asserts.install(tx)
    tensor_set.install(tx)
    same_dtype.install(tx)  # last: it wraps the lowerings above


@contextlib.contextmanager
def overriding(
    op: Any, impl: Callable[..., Any], *, jax_function: bool = False, needs_env: bool = False
) -> Iterator[None]:
    """Inside the block, ``op`` lowers to ``impl`` in torchax's environment; the previous lowering after it.

    For lowerings that hold only while something is traced (`init_sharded`'s build, one Trainer's step).
    """
    tx = env()
    previous = tx._ops.get(op)  # private: the env's op table, as in registry.register
    register(tx, op, impl, jax_function=jax_function, needs_env=needs_env)
    try:
        yield
    finally:
        if previous is None:
            del tx._ops[op]
        else:
            tx._ops[op] = previous


def tensors_not_meta() -> contextlib.AbstractContextManager[None]:
    """Inside the block, torchax tensors report ``is_meta`` False (they hold values; their torch storage is meta).

    ``torch.nn.init.trunc_normal_``, ``sparse_`` and ``dirac_`` return early for meta tensors, so
    without this they silently do nothing while `init_sharded` builds a model. Only there: elsewhere
    torch may read ``is_meta`` to avoid touching storage.
    """
    return overriding(torch.Tensor.is_meta.__get__, init_ops.is_meta)  # type: ignore[attr-defined]


@contextlib.contextmanager
def seeded(key: jax.Array) -> Iterator[None]:
    """Inside the block, torch random ops under torchax draw from ``key`` (a raw uint32 key)."""
    with env().override_property(prng=key):
        yield


def current_key() -> jax.Array:
    """The key torch random ops under torchax draw from next."""
    return env().param.prng


def continue_from(key: jax.Array) -> None:
    """Torch random ops draw from ``key`` next (inside a `seeded` block: the block still restores the old key)."""
    env().param.prng = key


def backend_started() -> bool:
    """Whether JAX has created its backends (after which the CPU device count is fixed)."""
    from jax._src import xla_bridge  # private: JAX has no public "is the backend up" query

    return bool(xla_bridge._backends)
