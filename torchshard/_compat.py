"""Compatibility shims that let torchax 0.0.13 import on torch builds without named-tensor overloads."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import re
from collections.abc import Iterator

import torch
import torch._ops

# torch 2.13 removed the named-tensor (Dimname) ATen overloads; torchax <= 0.0.13 still
# names them in tables built at import time. Only these names may be faked.
_NAMED_OVERLOAD = re.compile(r"(?i).*(dimname|names).*")
_LAST_BROKEN_TORCHAX = (0, 0, 13)


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


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def needs_named_overload_shim() -> bool:
    """True when torch lacks the named overloads and torchax is a release that still uses them."""
    torch_has_them = hasattr(torch.ops.aten.prod, "dim_Dimname")
    try:
        torchax_version = _version_tuple(importlib.metadata.version("torchax"))
    except importlib.metadata.PackageNotFoundError:
        return False
    return not torch_has_them and torchax_version <= _LAST_BROKEN_TORCHAX


@contextlib.contextmanager
def _placeholder_named_overloads() -> Iterator[None]:
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

    torch._ops.OpOverloadPacket.__getattr__ = getattr_or_placeholder
    try:
        yield
    finally:
        torch._ops.OpOverloadPacket.__getattr__ = original


def import_torchax() -> None:
    """Imports torchax and the modules it loads lazily, with the shim only if this pair needs it.

    `torchax.decompositions` is normally imported when the first environment is created;
    importing it here keeps the shim's window closed afterwards and creates no environment
    (which would initialise the JAX backend).
    """
    shim = _placeholder_named_overloads() if needs_named_overload_shim() else contextlib.nullcontext()
    with shim:
        for name in ("torchax", "torchax.decompositions", "torchax.amp", "torchax.interop"):
            importlib.import_module(name)


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
    try:
        return _version_tuple(importlib.metadata.version("torchax")) <= _LAST_BROKEN_TORCHAX
    except importlib.metadata.PackageNotFoundError:
        return False


def _gather_along_axis(input, dim, index, *, sparse_grad=False):
    """``aten.gather`` as ``take_along_axis``: a batched gather that GSPMD keeps sharded.

    torchax's own version indexes with full coordinate grids, which the partitioner cannot split,
    so ``cross_entropy`` on a batch-sharded step all-gathers the batch.
    """
    import jax.numpy as jnp

    if input.ndim == 0:
        return jnp.broadcast_to(input, index.shape)
    dim %= input.ndim
    # torch lets index be smaller than input in the other dims: only that corner is read.
    corner = tuple(slice(None) if d == dim else slice(0, index.shape[d]) for d in range(input.ndim))
    return jnp.take_along_axis(input[corner], index, axis=dim)


def _nll_loss_forward(input, target, weight, reduction, ignore_index):
    """``aten.nll_loss_forward`` as one fused pick-and-reduce.

    torch's decomposition (what torchax runs) adds a separate integer reduction of the valid
    targets and a scatter in the backward: about 8 % of a data-parallel MLP step here.
    """
    import jax.numpy as jnp

    batched = input.ndim == 2
    input, target = (input, target) if batched else (input[None], target[None])
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    picked = jnp.take_along_axis(input, safe[:, None], axis=1)[:, 0]
    w = valid.astype(input.dtype) if weight is None else jnp.where(valid, weight[safe], 0).astype(input.dtype)
    losses = -picked * w
    total = w.sum()
    if reduction == 0:
        return (losses if batched else losses[0]), total
    return (losses.sum() / total if reduction == 1 else losses.sum()), total


def _matmul(x, y):
    import jax.numpy as jnp

    return jnp.matmul(x, y)


def _jax_ops() -> dict[object, object]:
    """torch callables → jax implementations that keep shardings where torchax's do not.

    ``torch.matmul`` on batched (e.g. [batch, heads, seq, dim]) operands otherwise decomposes
    into reshapes around ``bmm`` that merge the batch and head dims, and GSPMD then gathers the
    heads a tensor-parallel attention had split.
    """
    return {
        torch.ops.aten.gather: _gather_along_axis,
        torch.ops.aten.nll_loss_forward: _nll_loss_forward,
        torch.matmul: _matmul,
        torch.Tensor.matmul: _matmul,
        torch.Tensor.__matmul__: _matmul,
    }


def _attention_jax(query, key, value, attn_mask, is_causal, scale):
    """[batch, heads, seq, dim] attention by ``jax.nn.dot_product_attention`` (grouped KV heads too)."""
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (query, key, value))
    mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None, None] if is_causal else None
    bias = None
    if attn_mask is not None:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + attn_mask.shape)
        if attn_mask.dtype == jnp.bool_:
            mask = attn_mask if mask is None else mask & attn_mask
        else:
            bias = attn_mask.astype(q.dtype)
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale)
    return jnp.swapaxes(out, 1, 2)


def _attention(reference):
    """``scaled_dot_product_attention`` that keeps heads sharded; dropout and odd ranks use ``reference``.

    torchax's version repeats grouped KV heads and multiplies through reshapes that make GSPMD
    gather the heads a tensor-parallel attention had split over the mesh.
    """

    def attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, env=None
    ):
        if dropout_p > 0 or query.ndim != 4 or (query.shape[1] != key.shape[1] and not enable_gqa):
            return reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env=env)
        from torchax.interop import call_jax

        return call_jax(_attention_jax, query, key, value, attn_mask, is_causal, scale)

    return attention


def fix_environment(env: object) -> None:
    """Applies the op fixes this torchax release needs to a torchax environment."""
    if needs_batch_norm_fix():
        env.override_op_definition(torch.ops.aten.native_batch_norm, _batch_norm_updating_stats)
    from torchax.ops import ops_registry

    for op, impl in _jax_ops().items():
        env._ops[op] = ops_registry.Operator(
            op, impl, is_jax_function=True, is_user_defined=True, needs_env=False, is_view_op=False
        )
    for op in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):
        reference = env._ops[op].func
        env._ops[op] = ops_registry.Operator(
            op, _attention(reference), is_jax_function=False, is_user_defined=True, needs_env=True, is_view_op=False
        )
