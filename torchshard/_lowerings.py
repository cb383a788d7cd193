"""torch ops lowered to JAX by torchshard where torchax's own lowering loses shardings or time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshard._errors import ShardingError


def gather_along_axis(input, dim, index, *, sparse_grad=False):
    """``aten.gather`` as ``take_along_axis``: a batched gather that GSPMD keeps sharded.

    torchax's own version indexes with full coordinate grids, which the partitioner cannot split,
    so ``cross_entropy`` on a batch-sharded step all-gathers the batch.
    """
    if input.ndim == 0:
        return jnp.broadcast_to(input, index.shape)
    dim %= input.ndim
    # torch lets index be smaller than input in the other dims: only that corner is read.
    corner = tuple(slice(None) if d == dim else slice(0, index.shape[d]) for d in range(input.ndim))
    return jnp.take_along_axis(input[corner], index, axis=dim)


def nll_loss_forward(input, target, weight, reduction, ignore_index):
    """``aten.nll_loss_forward`` as one fused pick-and-reduce.

    torch's decomposition (what torchax runs) adds a separate integer reduction of the valid
    targets and a scatter in the backward: about 8 % of a data-parallel MLP step here.
    """
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


def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """``aten.embedding``: rows of ``weight``; no gradient reaches row ``padding_idx`` (≥ 0; -1: none).

    torchax zeroes the padding row of the weight's tangent with an indexed set, which GSPMD
    applies at local row ``padding_idx`` of *every* shard when the table is split over its rows
    (FSDP): the first row of each shard then never trained. Cutting the gradient of the looked-up
    padding positions instead is the same gradient with no index into the table.
    """
    if scale_grad_by_freq:
        raise NotImplementedError("embedding(scale_grad_by_freq=True) has no lowering; scale the loss instead")
    out = jnp.take(weight, indices, axis=0)
    if padding_idx < 0:
        return out
    keep = (indices != padding_idx)[..., None]
    return jnp.where(keep, out, jax.lax.stop_gradient(out))


def _tokens_dot(x: jax.Array, w: jax.Array, w_contract: int) -> jax.Array:
    """``x[..., k]`` times the 2-D ``w`` over its dim ``w_contract``, with ``x``'s leading dims flattened first.

    Autodiff of the same dot on ``[batch, seq, k]`` gives the weight gradient two contracting
    dims (batch, seq); XLA on CPU then copies the ``[tokens, out]`` output gradient transposed
    before every weight-gradient dot (21 % of a 1-device Llama step). On ``[tokens, k]`` the
    weight-gradient dot has one contracting dim, which the dot kernel reads transposed in place.
    """
    x, w = _promoted(x, w)
    flat = x.reshape(-1, x.shape[-1])
    out = jax.lax.dot_general(flat, w, (((1,), (w_contract,)), ((), ())))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _promoted(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    dtype = jnp.result_type(*arrays)  # lax dots take one dtype; torchax's einsum promoted the same way
    return tuple(a.astype(dtype) for a in arrays)


def linear(input, weight, bias=None):
    """``F.linear`` (``input @ weight.T + bias``) as one dot over the flattened tokens (see `_tokens_dot`).

    ``weight`` stays in torch's ``[out, in]`` layout: the dot contracts its dim 1, so ``weight.T``
    is never materialised.
    """
    if weight.ndim == 2 and input.ndim >= 1 and input.shape[-1] != weight.shape[1]:
        raise ValueError(  # torch's words: jax's would name dot_general's contracting dims
            f"F.linear: mat1 and mat2 shapes cannot be multiplied: input {tuple(input.shape)} has "
            f"{input.shape[-1]} features, the weight {tuple(weight.shape)} takes {weight.shape[1]}"
        )
    if weight.ndim != 2 or input.ndim < 1 or not jnp.issubdtype(jnp.result_type(input, weight), jnp.floating):
        out = jnp.matmul(input, weight.T)  # 1-D weights and integer operands: torchax's own semantics
    else:
        out = _tokens_dot(input, weight, 1)
    return out if bias is None else out + bias


def matmul(x, y):
    """``torch.matmul`` as ``jnp.matmul``; ``[..., k] @ [k, n]`` over flattened tokens like `linear`.

    torch's version decomposes batched operands (e.g. [batch, heads, seq, dim]) into reshapes
    around ``bmm`` that merge the batch and head dims; GSPMD then gathers heads that a
    tensor-parallel attention had split.
    """
    if x.ndim > 2 and y.ndim == 2 and jnp.issubdtype(jnp.result_type(x, y), jnp.floating):
        return _tokens_dot(x, y, 0)
    return jnp.matmul(x, y)


def jax_lowerings() -> dict[Any, Callable[..., Any]]:
    """torch callables → JAX implementations (they take and return jax arrays)."""
    return {
        torch.ops.aten.gather: gather_along_axis,
        torch.ops.aten.nll_loss_forward: nll_loss_forward,
        torch.ops.aten.embedding: embedding,
        torch.nn.functional.linear: linear,
        torch.ops.aten.linear: linear,
        torch.matmul: matmul,
        torch.Tensor.matmul: matmul,
        torch.Tensor.__matmul__: matmul,
    }


def causal_blocks(seq: int) -> int:
    """Query blocks causal self-attention over ``seq`` positions is split into: at least 64 rows each, at most 8.

    Block ``i`` attends only to keys below the end of its own rows, so the dots and softmax cover
    ``(blocks + 1) / (2 * blocks)`` of the ``seq × seq`` square (5/8 with 4 blocks), as torch's
    CPU flash kernel gets from skipping masked tiles. Measured fwd+bwd on [16, 8, 256, 64]
    (XLA on CPU): 1 block 382 ms, 2 → 302, 4 → 270, 8 → 322; smaller blocks make dots too small.
    """
    for blocks in (8, 4, 2):
        if seq % blocks == 0 and seq // blocks >= 64:
            return blocks
    return 1


def _grouped(query: jax.Array, kv_heads: int, scale: float | None) -> jax.Array:
    """[batch, heads, seq, dim] queries, scaled, as [batch, kv_heads, group, seq, dim].

    Head ``n`` reads kv head ``n // group``, as torch's ``enable_gqa`` does.
    """
    b, n, s, h = query.shape
    scale = h**-0.5 if scale is None else scale
    return (query * jnp.asarray(scale, query.dtype)).reshape(b, kv_heads, n // kv_heads, s, h)


def _attend(
    q: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, bias: jax.Array | None
) -> jax.Array:
    """softmax(q·kᵀ + bias, masked)·v on [b, kv, group, s, dim] queries and [b, kv, t, dim] keys/values.

    (batch, kv head) are the leading batch dims of both dots and the contracting dim is minor,
    the layout XLA's batched dot kernels read in place: swapping to [batch, seq, heads, dim] for
    ``jax.nn.dot_product_attention`` cost 13 transposes per layer instead of 3. Grouped KV heads
    are read through the group dim instead of being repeated.
    """
    logits = jnp.einsum("bkgqh,bksh->bkgqs", q, key, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("bkgqs,bksh->bkgqh", probs, value)


def _as_grouped_mask(mask: jax.Array, heads: int, kv_heads: int) -> jax.Array:
    """A mask broadcastable to [batch, heads, s, t] as one broadcastable to [batch, kv_heads, group, s, t]."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    group = (kv_heads, heads // kv_heads) if mask.shape[1] == heads else (1, 1)
    return mask.reshape(mask.shape[0], *group, *mask.shape[2:])


def _causal(rows: int, cols: int, offset: int = 0) -> jax.Array:
    """torch's causal mask (top-left aligned) for query rows ``offset...offset+rows`` against ``cols`` keys."""
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0) + offset
    return row >= jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)


def attention_jax(query, key, value, attn_mask, is_causal, scale):
    """[batch, heads, seq, dim] attention in torch's layout (grouped KV heads too): see `_attend`."""
    b, n, s, h = query.shape
    kv_heads, t = key.shape[1], key.shape[2]
    q = _grouped(query, kv_heads, scale)
    blocks = causal_blocks(s) if is_causal and attn_mask is None and s == t else 1
    if blocks > 1:
        return _causal_blocked(q, key, value, blocks).reshape(b, n, s, h)
    mask, bias = _causal(s, t) if is_causal else None, None
    if attn_mask is not None:
        grouped = _as_grouped_mask(attn_mask, n, kv_heads)
        if grouped.dtype == jnp.bool_:
            mask = grouped if mask is None else mask & grouped
        else:
            bias = grouped
    return _attend(q, key, value, mask, bias).reshape(b, n, s, h)


def _causal_blocked(q: jax.Array, key: jax.Array, value: jax.Array, blocks: int) -> jax.Array:
    """Causal attention, query block ``i`` against keys ``[0, (i+1)·c)`` only, masked on its diagonal block."""
    c = q.shape[3] // blocks
    outs = []
    for i in range(blocks):
        end = (i + 1) * c
        outs.append(_attend(q[:, :, :, i * c : end], key[:, :, :end], value[:, :, :end], _causal(c, end, i * c), None))
    return jnp.concatenate(outs, axis=3)


ATTENTION_OPS = (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention)


def attention(reference: Callable[..., Any], call_jax: Callable[..., Any]) -> Callable[..., Any]:
    """``scaled_dot_product_attention`` that keeps heads sharded; dropout and odd ranks use ``reference``.

    torchax's version repeats grouped KV heads and multiplies through reshapes that make GSPMD
    gather the heads a tensor-parallel attention had split over the mesh.

    Args:
        reference: torchax's own implementation (a torch-level op that takes ``env=``).
        call_jax: calls a JAX function on torch tensors (torchax's ``interop.call_jax``).
    """

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, env=None):
        grouped = query.ndim == 4 and key.ndim == 4 and query.shape[1] % key.shape[1] == 0
        if dropout_p > 0 or not grouped or (query.shape[1] != key.shape[1] and not enable_gqa):
            return reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env=env)
        return call_jax(attention_jax, query, key, value, attn_mask, is_causal, scale)

    return sdpa


CROSS_ENTROPY_OPS = (torch.nn.functional.cross_entropy,)
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def cross_entropy_jax(logits, target, ignore_index, reduction, float32_out=False):
    """Class-index cross entropy of ``[N, C]`` logits, reduced by ``"mean"`` (over valid rows) or ``"sum"``.

    Computed in float32 at least, returned in the logits' dtype (``float32_out``: in float32).
    One pass over the logits: ``logsumexp − logits[target]``, the pick a compare with an iota.
    Its gradient, ``softmax − one_hot``, is elementwise; torch's decomposition (log_softmax, then
    a gather) differentiates into a zero ``[N, C]`` buffer plus a scatter-add, and under FSDP
    re-shards the vocabulary-sharded logits with an all-to-all (15.6 MiB per device per Llama step).
    """
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    valid = target != ignore_index
    hit = jax.lax.broadcasted_iota(target.dtype, x.shape, 1) == target[:, None]
    picked = jnp.sum(jnp.where(hit, x, 0), axis=1)
    loss = jnp.sum(jnp.where(valid, jax.nn.logsumexp(x, axis=1) - picked, 0))
    if reduction == "mean":
        loss = loss / valid.sum()  # every row ignored: 0 / 0 = nan, as in torch
    return loss if float32_out else loss.astype(logits.dtype)


def cross_entropy(call_jax: Callable[..., Any]) -> Callable[..., Any]:
    """``F.cross_entropy`` through `cross_entropy_jax` for [N, C] logits with class targets and no class weights.

    Class weights, label smoothing, probability targets, extra dims and ``reduction="none"`` run
    torch's own decomposition, as before. Under autocast the loss is float32 (torch's policy).

    Args:
        call_jax: calls a JAX function on torch tensors (torchax's ``interop.call_jax``).
    """

    def fused(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
              label_smoothing=0.0, env=None):  # fmt: skip
        if size_average is not None or reduce is not None:
            reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
        simple = weight is None and label_smoothing == 0.0 and reduction in ("mean", "sum")
        if not (simple and input.ndim == 2 and target.ndim == 1 and not target.dtype.is_floating_point):
            return torch.ops.aten.cross_entropy_loss(
                input, target, weight, _REDUCTIONS[reduction], ignore_index, label_smoothing
            )
        autocast = env is not None and env.param.autocast_dtype is not None
        return call_jax(cross_entropy_jax, input, target, ignore_index, reduction, autocast)

    return fused


# matrix products whose operands torch requires to share a dtype; torchax would silently promote an
# integer batch fed to a float model (positions of the two matrix operands in the op's arguments)
SAME_DTYPE = {
    torch.nn.functional.linear: ("F.linear", (0, 1)),
    torch.ops.aten.mm: ("mm", (0, 1)),
    torch.ops.aten.bmm: ("bmm", (0, 1)),
    torch.ops.aten.addmm: ("addmm", (1, 2)),
    torch.ops.aten.linear: ("linear", (0, 1)),
    torch.matmul: ("matmul", (0, 1)),
    torch.Tensor.matmul: ("matmul", (0, 1)),
    torch.Tensor.__matmul__: ("@", (0, 1)),
}


def same_dtype_kind(name: str, positions: tuple[int, int], impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` (a JAX lowering) that refuses an integer operand next to a floating one, as torch does."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        a, b = (args[i] for i in positions)
        if jnp.issubdtype(a.dtype, jnp.floating) != jnp.issubdtype(b.dtype, jnp.floating):
            raise ShardingError(
                f"{name} of a {a.dtype}{list(a.shape)} and a {b.dtype}{list(b.shape)} operand: torch refuses mixed "
                f"integer/floating matrix products (JAX would promote silently); cast the batch, e.g. x.float()"
            )
        return impl(*args, **kwargs)

    return guarded
