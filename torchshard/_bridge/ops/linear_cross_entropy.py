"""``ts.linear_cross_entropy``: an LM head and its cross entropy, chunked over tokens, never [tokens, vocab] logits."""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import torch
import torch.utils.checkpoint

from torchshard._base.validate import int_problems, raise_for_arguments
from torchshard._bridge.ops import tokamax_loss, tokens
from torchshard._bridge.ops.flash import RECOMPUTE_SCOPE
from torchshard._bridge.ops.loss_edges import mean_over_valid, out_of_range_nan
from torchshard._bridge.tensors import call_jax

# the default chunk holds at most this many logits (1 GiB in float32, over all devices together): the
# 128,256-word vocabulary of Llama 3 takes 2,092 tokens a chunk, and 16,384 tokens 8 chunks
LOGITS_PER_CHUNK = 2**28
# the name scope of the loss' loop, forward and backward: its float32-accumulated dots are the loss' own
LOSS_SCOPE = "linear_cross_entropy"
Reduction = Literal["mean", "sum"]


def chunk_count(tokens_: int, vocab: int, chunk_tokens: int | None) -> tuple[int, int]:
    """(chunks, tokens per chunk) for ``tokens_`` tokens: chunks of at most ``chunk_tokens`` (default: by
    `LOGITS_PER_CHUNK`); the last ``chunks × per − tokens_`` are padding.

    The fewest chunks that divide the tokens evenly, if at most twice as many as needed: padding
    would make the chunks' tokens straddle the devices' runs, which GSPMD then gathers.

    Examples:
        >>> chunk_count(16_384, 128_256, None)
        (8, 2048)
        >>> chunk_count(24, 10, 5), chunk_count(37, 10, 8)  # 6 chunks of 4; 37 is prime: 5 chunks of 8, padded
        ((6, 4), (5, 8))
    """
    limit = chunk_tokens if chunk_tokens is not None else max(1, LOGITS_PER_CHUNK // max(vocab, 1))
    needed = max(1, math.ceil(tokens_ / limit))
    chunks = next((k for k in range(needed, 2 * needed + 1) if tokens_ % k == 0), needed)
    return chunks, max(1, math.ceil(tokens_ / chunks))


@jax.custom_vjp
def _logits(h: jax.Array, w: jax.Array) -> jax.Array:
    """``h @ w.T`` of one chunk, accumulated and returned in float32 (the loss' softmax runs in float32).

    Its gradient flows back in the inputs' dtype, as torch autocast's ``.float()`` hands it back: the
    head's backward matmuls then run in bf16 under a bf16 policy, not in float32 against a bf16 weight.
    """
    return jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _logits_fwd(h: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _logits(h, w), (h, w)


def _logits_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    h, w = res
    g = g.astype(h.dtype)
    dh = jax.lax.dot_general(g, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    dw = jax.lax.dot_general(g, h, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dh.astype(h.dtype), dw.astype(w.dtype)


_logits.defvjp(_logits_fwd, _logits_bwd)


def _chunk(x: jax.Array, k: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, k, axis=1, keepdims=False)


def _forward(ignore_index: int, hidden: jax.Array, weight: jax.Array, labels: jax.Array):
    """(summed loss over valid tokens, per-token log-sum-exp [chunks, per]) of ``[per, chunks, h]`` hidden states."""

    def step(total, k):
        logits, y = _logits(_chunk(hidden, k), weight), _chunk(labels, k)
        lse = jax.nn.logsumexp(logits, axis=1)
        hit = jax.lax.broadcasted_iota(y.dtype, logits.shape, 1) == y[:, None]
        picked = jnp.sum(jnp.where(hit, logits, 0.0), axis=1)
        return total + jnp.sum(jnp.where(y != ignore_index, lse - picked, 0.0)), lse

    return jax.lax.scan(step, jnp.float32(0), jnp.arange(hidden.shape[1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def summed_loss(ignore_index: int, hidden: jax.Array, weight: jax.Array, labels: jax.Array) -> jax.Array:
    """Σ over tokens whose label is not ``ignore_index`` of ``logsumexp(logits) − logits[label]`` (float32).

    ``hidden`` is ``[per, chunks, h]``: chunk ``k`` is ``hidden[:, k]``, so when the tokens are split
    over devices in contiguous runs (``per`` divisible by their number) every chunk is spread over
    all of them. The backward recomputes each chunk's logits from the saved log-sum-exp.

    Examples:
        >>> h, w = jnp.ones((2, 3, 4)), jnp.zeros((5, 4))
        >>> round(float(summed_loss(-100, h, w, jnp.zeros((2, 3), jnp.int32))), 4)  # 6 × log(5)
        9.6566
    """
    with jax.named_scope(LOSS_SCOPE):
        return _forward(ignore_index, hidden, weight, labels)[0]


@jax.named_scope(LOSS_SCOPE)
def _summed_fwd(ignore_index: int, hidden, weight, labels):
    total, lse = _forward(ignore_index, hidden, weight, labels)
    return total, (hidden, weight, labels, lse)


@jax.named_scope(LOSS_SCOPE)
def _summed_bwd(ignore_index: int, res: tuple, g: jax.Array):
    hidden, weight, labels, lse = res

    def step(dw, k):
        h, y = _chunk(hidden, k), _chunk(labels, k)
        with jax.named_scope(RECOMPUTE_SCOPE):  # MFU counts the recomputed logits once
            p = jnp.exp(_logits(h, weight) - lse[k][:, None])
        hit = jax.lax.broadcasted_iota(y.dtype, p.shape, 1) == y[:, None]
        # g multiplies inside the where: with every label ignored, a mean's g is 1/0, and 0 × inf would be nan
        dlogits = jnp.where((y != ignore_index)[:, None], (p - hit.astype(p.dtype)) * g, 0.0)
        dlogits = dlogits.astype(h.dtype)  # the matmuls run in the inputs' dtype, accumulating in float32
        dh = jax.lax.dot_general(dlogits, weight, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        dw = dw + jax.lax.dot_general(dlogits, h, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dw, dh.astype(h.dtype)

    dw, dh = jax.lax.scan(step, jnp.zeros(weight.shape, jnp.float32), jnp.arange(hidden.shape[1]))
    return jnp.swapaxes(dh, 0, 1), dw.astype(weight.dtype), None


# optimize_remat: under a remat policy that saves matmul outputs, JAX would otherwise keep what the
# forward's loop computes instead of replaying it (as flash attention's kernel does)
summed_loss.defvjp(_summed_fwd, _summed_bwd, optimize_remat=True)


def _flat(hidden: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[tokens, h]`` hidden states and ``[tokens]`` labels, in one order (any: the loss sums over tokens).

    Under context parallelism, ``[rows, seq, h]`` is flattened as the linear lowering flattens it
    (sequence-chunk-major: it stays sharded with no transfer); tokens that come flat are pinned to
    the rows' and sequence's axes (GSPMD moves them there with one all-to-all).
    """
    if hidden.ndim >= 3:
        return tokens.flatten(hidden), tokens.flatten(labels[..., None])[:, 0]
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    return tokens.constrain_flat(hidden), tokens.constrain_flat(labels)


def loss_jax(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    ignore_index: int,
    chunk_tokens: int | None,
    reduction: Reduction,
    float32_out: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """The chunked loss of ``hidden [..., h]`` against ``labels [...]``, reduced over valid tokens, in ``hidden``'s
    dtype (``float32_out``: in float32); with ``implementation``, tokamax's (`tokamax_loss.IMPLEMENTATIONS`)
    computes each token's loss instead of torchshard's chunks.

    Examples:
        >>> h, w, y = jnp.ones((2, 3, 4)), jnp.zeros((5, 4)), jnp.array([[0, 1, -100], [2, 3, 4]])
        >>> round(float(loss_jax(h, w, y, -100, 2, "mean")), 4)  # log(5)
        1.6094
    """
    out_dtype = jnp.float32 if float32_out else hidden.dtype
    hidden, labels = _flat(hidden, labels)
    if implementation is not None:
        total = tokamax_loss.summed(implementation, hidden, weight, labels, ignore_index)
        return _reduced(total, labels, ignore_index, weight.shape[0], reduction).astype(out_dtype)
    n = labels.shape[0]
    chunks, per = chunk_count(n, weight.shape[0], chunk_tokens)
    if chunks * per > n:  # padding tokens carry the ignored label
        hidden = jnp.pad(hidden, ((0, chunks * per - n), (0, 0)))
        labels = jnp.pad(labels, (0, chunks * per - n), constant_values=ignore_index)
    if chunks == 1:  # nothing to save by recomputing: autodiff keeps the one chunk's logits (and XLA cannot
        # merge a recomputation with the forward, counting the head's matmul as recomputed work in MFU)
        with jax.named_scope(LOSS_SCOPE):
            total = _forward(ignore_index, hidden.reshape(per, 1, -1), weight, labels.reshape(per, 1))[0]
    else:
        total = summed_loss(ignore_index, hidden.reshape(per, chunks, -1), weight, labels.reshape(per, chunks))
    return _reduced(total, labels, ignore_index, weight.shape[0], reduction).astype(out_dtype)


def _reduced(total: jax.Array, labels: jax.Array, ignore_index: int, vocab: int, reduction: Reduction) -> jax.Array:
    """The summed loss, nan where a label is out of range, over the valid tokens' count for a mean."""
    total = total * out_of_range_nan(labels, ignore_index, vocab)
    return mean_over_valid(total, labels != ignore_index, reduction)


def _torch_chunk_sum(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return torch.nn.functional.cross_entropy((h @ w.T).float(), y, ignore_index=ignore_index, reduction="sum")


def _loss_torch(hidden, weight, labels, ignore_index: int, chunk_tokens: int | None, reduction: Reduction):
    """Eager torch: each chunk's loss under ``torch.utils.checkpoint``, so its logits are freed and recomputed."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    _, per = chunk_count(labels.shape[0], weight.shape[0], chunk_tokens)
    parts = [
        torch.utils.checkpoint.checkpoint(_torch_chunk_sum, h, weight, y, ignore_index, use_reentrant=False)
        for h, y in zip(hidden.split(per), labels.split(per), strict=True)
    ]
    total = torch.stack(parts).sum() if parts else hidden.new_zeros((), dtype=torch.float32)
    return total / (labels != ignore_index).sum() if reduction == "mean" else total


def _on_jax(t: torch.Tensor) -> bool:
    return t.device.type == "jax"  # torchax tensors, and the lazy views slicing them makes


def _problems(hidden: Any, weight: Any, labels: Any, ignore_index: Any, chunk_tokens: Any, reduction: Any):
    named = {"hidden": hidden, "weight": weight, "labels": labels}
    problems = [
        f"{k} must be a torch tensor, got {type(v).__name__}"
        for k, v in named.items()
        if not isinstance(v, torch.Tensor)
    ]
    problems += int_problems("chunk_tokens", chunk_tokens, minimum=1, none="chunks of the default size")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        problems.append(f"ignore_index={ignore_index!r} must be an int (the label of tokens to leave out)")
    if reduction not in ("mean", "sum"):
        problems.append(f"reduction={reduction!r} must be 'mean' or 'sum'")
    if problems:
        return problems
    kinds = {k: _on_jax(v) for k, v in named.items()}
    if len(set(kinds.values())) > 1:
        on_jax = ", ".join(k for k, v in kinds.items() if v)
        problems.append(f"{on_jax} on the jax device and the rest plain torch tensors; put all three in one place")
    if meta := [k for k, v in named.items() if v.device.type == "meta"]:
        problems.append(
            f"{', '.join(meta)} on the meta device, which holds shapes but no values; load or initialise the "
            f"weights first (e.g. ts.init_sharded, or model.to_empty(device='cpu') and load_state_dict)"
        )
    return problems + _shape_problems(hidden, weight, labels)


def _label_problems(labels: torch.Tensor, ignore_index: int, vocab: int) -> list[str]:
    """Eager torch's refusal of a label outside ``[0, vocab)``, as a problem naming the first such value."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if not bool(bad.any()):
        return []
    first, more = int(labels[bad].reshape(-1)[0]), int(bad.sum()) - 1
    also = f" (and {more} more out of range)" if more else ""
    return [
        f"labels hold {first}{also}, outside the vocabulary's [0, {vocab}) and not ignore_index={ignore_index}; "
        f"fix the labels, or mark those tokens ignore_index"
    ]


def _shape_problems(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> list[str]:
    problems = []
    if weight.ndim != 2:
        problems.append(f"weight must be the head's [vocab, hidden] matrix, got shape {tuple(weight.shape)}")
    elif hidden.ndim < 1 or hidden.shape[-1] != weight.shape[1]:
        problems.append(
            f"hidden {tuple(hidden.shape)} must end in the weight's hidden size {weight.shape[1]} "
            f"(weight {tuple(weight.shape)} is [vocab, hidden], as nn.Linear keeps it)"
        )
    if hidden.ndim >= 1 and tuple(labels.shape) != tuple(hidden.shape[:-1]):
        problems.append(
            f"labels {tuple(labels.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])} "
            f"(one label per token)"
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        problems.append(f"labels must be class indices (an integer dtype, e.g. torch.long), got {labels.dtype}")
    if not (hidden.dtype.is_floating_point and weight.dtype.is_floating_point):
        problems.append(f"hidden and weight must be floating, got {hidden.dtype} and {weight.dtype}")
    elif hidden.dtype != weight.dtype:
        problems.append(f"hidden is {hidden.dtype} and weight {weight.dtype}: cast one (as F.linear would need)")
    return problems


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    reduction: Reduction = "mean",
    float32_out: bool = False,
    implementation: str | None = None,
) -> torch.Tensor:
    """`linear_cross_entropy` with a ``reduction`` and, with ``float32_out``, the loss in float32 whatever the
    inputs' dtype (as transformers' causal-LM loss returns it); on torchax tensors, ``implementation`` (one of
    `tokamax_loss.IMPLEMENTATIONS`) computes it by tokamax's fused loss."""
    header = "invalid linear_cross_entropy arguments"
    raise_for_arguments(_problems(hidden, weight, labels, ignore_index, chunk_tokens, reduction), header=header)
    if not _on_jax(hidden):
        raise_for_arguments(_label_problems(labels, ignore_index, weight.shape[0]), header=header)
        labels = labels.long()  # torch's cross entropy takes int64 class indices only
        loss = _loss_torch(hidden, weight, labels, ignore_index, chunk_tokens, reduction)
        return loss if float32_out else loss.to(hidden.dtype)
    arguments = (ignore_index, chunk_tokens, reduction, float32_out, implementation)
    return call_jax(loss_jax, hidden, weight, labels, *arguments)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index=...)`` without ever holding the logits whole.

    The tokens are cut into chunks; each chunk's logits are computed, reduced to its loss and
    dropped, and the backward recomputes them chunk by chunk, accumulating the hidden states' and
    the weight's gradients. Memory then grows with one chunk's logits, not [tokens, vocab]. Same
    loss and gradients as the plain formula (the mean over tokens whose label is not
    ``ignore_index``), with the softmax in float32. On torchax tensors (inside a `Trainer` step) it
    is one JAX loop with a custom gradient, and works with the weight sharded over the vocabulary
    (a column-wise tensor-parallel head) or FSDP-sharded; on plain torch tensors each chunk runs
    under ``torch.utils.checkpoint``. A transformers causal LM called with ``labels=`` under a
    `Trainer` uses it without being asked (``Trainer(fused_loss=False)`` turns that off).

    Args:
        hidden: ``[..., hidden]`` final hidden states (the LM head's input), floating.
        weight: ``[vocab, hidden]`` head weight, as ``nn.Linear`` keeps it; same dtype as ``hidden``.
        labels: ``[...]`` class indices, one per token (an integer dtype).
        ignore_index: tokens with this label add nothing to the loss nor to the count it is averaged over.
        chunk_tokens: tokens per chunk at most; default: as many as keep a chunk's logits under
            2**28 values (2,092 tokens for a 128,256-word vocabulary).

    Returns:
        The mean loss, a scalar in ``hidden``'s dtype (computed in float32). If every label is ignored it
        is nan and the gradients are 0, as eager torch's. A label outside ``[0, vocab)`` (other than
        ``ignore_index``) inside a step, where nothing can raise, makes the loss and every gradient nan:
        ``Trainer(skip_nonfinite=True)`` skips such a step, changing no parameter.

    Raises:
        ArgumentError: shapes that disagree, non-integer labels, floating dtypes that differ,
            tensors in different places or on the meta device (no values), ``chunk_tokens`` that is
            not a positive int, or (on plain torch tensors, as eager torch raises) a label outside
            ``[0, vocab)`` that is not ``ignore_index``, named with the vocabulary's size.

    Examples:
        >>> hidden, weight = torch.randn(6, 8), torch.randn(32, 8)
        >>> labels = torch.tensor([1, 5, -100, 7, 31, 0])
        >>> loss = ts.linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
        >>> expected = torch.nn.functional.cross_entropy(hidden @ weight.T, labels)
        >>> bool(torch.allclose(loss, expected, atol=1e-6))
        True
    """
    return head_loss(hidden, weight, labels, ignore_index=ignore_index, chunk_tokens=chunk_tokens)
