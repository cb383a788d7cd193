"""``scaled_dot_product_attention`` in torch's layout that keeps heads sharded, through the kernel `kernels` picks.

The tiled kernel (`flash`: no saved scores) everywhere it must; cuDNN's fused flash attention on GPUs
and splash attention on TPUs where they take the call; ``jax.nn.dot_product_attention``'s XLA form
or tokamax's implementations when forced. A library kernel is probed (`probes`) before its first use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchshard._bridge.loaded import Environment, interop
from torchshard._bridge.ops import flash, kernels, probes, splash, tokamax_attention
from torchshard._bridge.ops.fused import fused_jax
from torchshard._bridge.registry import register
from torchshard._bridge.scopes import current_module


def _grouped(query: jax.Array, kv_heads: int, scale: float | None) -> jax.Array:
    """[batch, heads, seq, dim] queries, scaled, as [batch, kv_heads, group, seq, dim].

    Head ``n`` reads kv head ``n // group``, as torch's ``enable_gqa`` does.
    """
    b, n, s, h = query.shape
    scale = h**-0.5 if scale is None else scale
    return (query * jnp.asarray(scale, query.dtype)).reshape(b, kv_heads, n // kv_heads, s, h)


def _as_grouped_mask(mask: jax.Array, heads: int, kv_heads: int) -> jax.Array:
    """A mask broadcastable to [batch, heads, s, t] as one broadcastable to [batch, kv_heads, group, s, t]."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    group = (kv_heads, heads // kv_heads) if mask.shape[1] == heads else (1, 1)
    return mask.reshape(mask.shape[0], *group, *mask.shape[2:])


def attention_jax(query, key, value, attn_mask, is_causal, scale, *, tiles: tuple[int, int] | None = None):
    """[batch, heads, seq, dim] attention in torch's layout (grouped KV heads too): see `flash.attend`."""
    b, n, s = query.shape[:3]
    kv_heads, t = key.shape[1], key.shape[2]
    q = _grouped(query, kv_heads, scale)
    mask = bias = None
    if attn_mask is not None:
        grouped = _as_grouped_mask(attn_mask, n, kv_heads)
        mask, bias = (grouped, None) if grouped.dtype == jnp.bool_ else (None, grouped)
    rows, keys = tiles or (flash.tile_size(s), flash.tile_size(t))
    tiling = flash.Tiling(rows, keys, is_causal)
    return flash.attend(tiling, q, key, value, mask, bias).reshape(b, n, s, value.shape[-1])


ATTENTION_OPS = (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention)


def _call(query, key, value, attn_mask, dropout_p, is_causal) -> kernels.Call:
    mask = None if attn_mask is None else "bool" if attn_mask.dtype == torch.bool else "float"
    return kernels.Call(
        current_module(),
        tuple(query.shape),
        tuple(key.shape),
        tuple(value.shape),
        np.dtype(_jax_dtype(query.dtype)),
        mask,
        bool(is_causal),
        dropout_p > 0,
    )


_DTYPES = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16, torch.float32: jnp.float32}


def _jax_dtype(dtype: torch.dtype) -> Any:
    return _DTYPES.get(dtype, jnp.float32)


def attention(reference: Callable[..., Any], call_jax: Callable[..., Any]) -> Callable[..., Any]:
    """``scaled_dot_product_attention`` through the kernel `kernels.choose` picks; heads stay sharded.

    torchax's version repeats grouped KV heads and multiplies through reshapes that make GSPMD
    gather the heads a tensor-parallel attention had split over the mesh. Dropout, odd ranks and
    empty sequences use ``reference``.

    Args:
        reference: torchax's own implementation (a torch-level op that takes ``env=``).
        call_jax: calls a JAX function on torch tensors (torchax's ``interop.call_jax``).
    """

    def torchax_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env):
        if attn_mask is None:
            return reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env=env)
        # torchax's softmax over no key gives NaN values and NaN gradients; torch's SDPA gives those rows zeros
        seen = (attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")).any(-1, keepdim=True)
        open_rows = attn_mask | ~seen if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~seen, 0)
        out = reference(query, key, value, open_rows, dropout_p, is_causal, scale, enable_gqa, env=env)
        return out.masked_fill(~seen, 0)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, env=None):
        grouped = query.ndim == 4 and key.ndim == 4 and query.shape[1] % key.shape[1] == 0
        empty = grouped and (query.shape[2] == 0 or key.shape[2] == 0)  # no tile to fold: torchax's own op
        # one key head broadcasts over the query heads in torch without enable_gqa (Falcon's multi-query attention)
        if not grouped or empty or (query.shape[1] != key.shape[1] and not enable_gqa and key.shape[1] != 1):
            return torchax_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env)
        policy = kernels.current(_platform())
        call = _call(query, key, value, attn_mask, dropout_p, is_causal)
        mask_shape = None if attn_mask is None else tuple(attn_mask.shape)
        probe = functools.partial(_probe, call=call, platform=policy.platform, mask_shape=mask_shape)
        choice = kernels.choose(policy.requested, call, policy.platform, devices=policy.devices, probe=probe)
        if policy.record is not None:
            policy.record.setdefault(call.site, choice)
        if choice.kernel == "reference":
            return torchax_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env)
        return call_jax(form(choice.kernel), query, key, value, attn_mask, bool(is_causal), scale)

    return sdpa


def _splash(query, key, value, attn_mask, is_causal, scale):
    return splash.splash_attention(query, key, value, causal=is_causal, scale=scale)  # it takes no mask


def form(kernel: str) -> Callable[..., Any]:
    """The JAX function of ``kernel`` (a `kernels.Choice`'s) on torch's layout:
    ``(query, key, value, attn_mask, is_causal, scale) -> out``.

    Examples:
        >>> form("tokamax:xla").func is tokamax_attention.attend
        True
    """
    if kernel in ("xla", "cudnn"):
        return functools.partial(fused_jax, "xla" if kernel == "xla" else "cudnn")
    if kernel.startswith("tokamax:"):
        return functools.partial(tokamax_attention.attend, kernel.removeprefix("tokamax:"))
    return _splash if kernel == "splash" else attention_jax


def _probe(kernel: str, *, call: kernels.Call, platform: str, mask_shape: tuple[int, ...] | None) -> str | None:
    return probes.failure(kernel, form(kernel), call, platform, mask_shape)


def _platform() -> str:
    return jax.default_backend()


def install(tx: Environment) -> None:
    """Registers the lowering in ``tx``, torchax's own kept as the fallback."""
    for op in ATTENTION_OPS:
        reference = tx._ops[op].func  # private: torchax's own lowering, kept as the fallback
        register(tx, op, attention(reference, interop.call_jax), jax_function=False, needs_env=True)
