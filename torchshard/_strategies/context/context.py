"""Context parallelism: the batch's sequence dim split over a mesh axis, every SDPA call run as ring attention."""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh

from torchshard._base.errors import ArgumentError, raise_if_any
from torchshard._base.validate import describe_mesh
from torchshard._bridge.constants import index_constants_folded
from torchshard._bridge.env import overriding
from torchshard._bridge.ops import kernels, tokens
from torchshard._bridge.ops.attention import ATTENTION_OPS
from torchshard._bridge.scopes import current_module
from torchshard._strategies.context import documents, hf_documents
from torchshard._strategies.context.option import SUPPORTED, ContextParallel
from torchshard._strategies.context.ring_attention import context_attention

Pattern = tuple[bool, int | None]  # (causal, the causal sliding window or None) of a constant mask


def sequence_multiple(context: ContextParallel, mesh: Mesh) -> int:
    """What every sequence length must be a multiple of: the axis size, twice that when load-balanced."""
    return mesh.shape[context.axis] * (2 if context.load_balance else 1)


def _lengths_that_work(length: int, multiple: int) -> str:
    below = length // multiple * multiple
    return f"{below} or {below + multiple}" if below else f"{multiple}"


def _split_problem(what: str, length: int, context: ContextParallel, mesh: Mesh) -> list[str]:
    multiple = sequence_multiple(context, mesh)
    if length % multiple == 0:
        return []
    balance = " × 2 (load_balance=True)" if context.load_balance else ""
    return [
        f"{what}: the sequence (length {length}) does not split into {multiple} equal chunks ({context.axis} size "
        f"{mesh.shape[context.axis]}{balance}); use a length that is a multiple of {multiple}, e.g. "
        f"{_lengths_that_work(length, multiple)} (pad, or trim the batch)"
    ]


def model_problems(context: ContextParallel | None, model: Any) -> list[str]:
    """What in ``model`` context parallelism cannot split, found before a step is traced.

    A sparse-attention indexer (transformers' DeepSeek-V3.2, A.X-K2, GLM-DSA... attentions hold
    one as ``indexer``) picks each query's keys by a top-k over the whole sequence, from the
    attention mask, in the model's own code: no SDPA to split, and packed rows' masks reach it as
    document ids it cannot read.
    """
    if context is None or not isinstance(model, torch.nn.Module):
        return []
    found = [
        f"{name}.indexer"
        for name, m in model.named_modules()
        if isinstance(getattr(m, "indexer", None), torch.nn.Module)
    ]
    if not found:
        return []
    return [
        f"{type(model).__name__} has sparse-attention indexers ({found[0]}, {len(found)} in all) that select "
        f"each query's keys by a top-k over the whole sequence in the model's own code; {context} cannot split "
        f"that selection, so it refuses rather than gather the sequence or read the mask wrong; train it without "
        f"context= (data, FSDP, tensor and expert parallelism split it)"
    ]


def sequence_problems(context: ContextParallel | None, mesh: Mesh, what: str, shape: Sequence[int]) -> list[str]:
    """A batch leaf of rank ≥ 2 whose dim 1 (the sequence) the context axis cannot split."""
    if context is None or len(shape) < 2:
        return []
    return _split_problem(f"{what} {tuple(shape)}", shape[1], context, mesh)


def _mask_pattern(mask: Any, length: int) -> Pattern | None:
    """(True, None) for torch's causal mask, (True, w) for a causal sliding window of ``w`` keys (query ``i`` sees
    ``i - w < j <= i``, transformers' ``sliding_window``), (False, None) for an all-visible mask, and None for
    anything else (or a traced mask).

    Bool masks keep ``True``; float (additive) masks keep 0 and drop -inf or values near the dtype's minimum.
    """
    if isinstance(mask, jax.core.Tracer):
        return None
    values = np.asarray(mask)
    if values.ndim < 2 or values.shape[-2:] != (length, length):
        return None
    if values.dtype != np.bool_:
        dropped = values <= np.finfo(values.dtype).min / 2
        if not np.all(dropped | (values == 0)):
            return None
        values = ~dropped
    values = values.reshape(-1, length, length)
    if np.all(values):
        return False, None
    window = int(values[0].sum(-1).max())
    rows, cols = np.arange(length)[:, None], np.arange(length)[None, :]  # an S×S bool band, not S×S indices
    if window < 1 or not np.all(values == ((rows >= cols) & (rows - cols < window))):
        return None
    return True, window if window < length else None


def _segments(mask: Any, batch: int, length: int) -> tuple[jax.Array | None, list[str]]:
    """The [b, s] document ids an integer ``attn_mask`` (`document_mask` under tracing) carries, or why it cannot."""
    if mask is None or not jnp.issubdtype(mask.dtype, jnp.integer):
        return None, []
    if mask.ndim != 4 or mask.shape[1:] != (1, 1, length) or mask.shape[0] not in (1, batch):
        return None, [
            f"integer attn_mask {mask.dtype}{list(mask.shape)} is not ts.document_mask's document ids [{batch}, 1, 1, "
            f"{length}]; pass ts.document_mask(position_ids) to scaled_dot_product_attention unchanged"
        ]
    return mask.reshape(mask.shape[0], length), []


def _call_problems(
    context: ContextParallel, mesh: Mesh, query: Any, key: Any, mask: Any, dropout_p: Any, enable_gqa: bool
) -> list[str]:
    if query.ndim != 4 or key.ndim != 4:
        return [f"needs 4-D [batch, heads, seq, dim] query and key, got ranks {query.ndim} and {key.ndim}"]
    problems = []
    if not isinstance(dropout_p, int | float) or dropout_p != 0:
        problems.append(
            f"dropout_p={dropout_p} is not supported; set the model's attention dropout to 0 "
            f"(e.g. config.attention_dropout=0.0)"
        )
    (heads, length), (kv_heads, kv_length) = (query.shape[1], query.shape[2]), (key.shape[1], key.shape[2])
    if length != kv_length:
        problems.append(
            f"queries ({length}) and keys ({kv_length}) differ in length: the call attends across something other "
            f"than the one sequence context parallelism splits (cross-attention, or a dim other than the tokens); "
            f"train this model without context="
        )
    if heads % kv_heads or (heads != kv_heads and not enable_gqa):
        problems.append(
            f"{heads} query heads and {kv_heads} key/value heads need enable_gqa=True and {heads} % "
            f"{kv_heads} == 0, as in torch"
        )
    segments, unreadable = _segments(mask, query.shape[0], length) if length == kv_length else (None, [])
    problems += unreadable
    if segments is None and mask is not None and length == kv_length and not unreadable:
        problems += _mask_problems(mask, length)
    return problems + _split_problem("the attention's", length, context, mesh)


def _mask_problems(mask: Any, length: int) -> list[str]:
    if _mask_pattern(mask, length) is not None:
        return []
    what = f"attn_mask {mask.dtype}{list(mask.shape)}"
    if isinstance(mask, jax.core.Tracer):
        built = hf_documents.built_from(mask)
        if built is not None:
            return [f"{what} is traced: {built[0]}; {SUPPORTED}; {built[1]}"]
        return [
            f"{what} is traced, computed in the step from the batch or the model's tensors (a padding attention_mask, "
            f"a learned or input-dependent bias); {SUPPORTED}: pass no such mask (unpadded rows, no bias), or train "
            f"without context="
        ]
    return [
        f"{what} is a constant mask but neither all-visible, causal nor a causal sliding window; {SUPPORTED}: "
        f"build one of those, or train without context="
    ]


def _sdpa(
    context: ContextParallel, mesh: Mesh, row_axes: tuple[str, ...], calls: list[int]
) -> Callable[..., jax.Array]:
    """``scaled_dot_product_attention`` (a JAX-level lowering) as context-parallel attention over the axis."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(1)
        problems = _call_problems(context, mesh, query, key, attn_mask, dropout_p, enable_gqa)
        shapes, site = f"query {list(query.shape)}, key {list(key.shape)}", current_module()
        called = f"scaled_dot_product_attention({shapes})" + (f" called by {site}" if site else "")
        raise_if_any(problems, header=f"{called} under {context} on {describe_mesh(mesh)}")
        _record_ring(context, mesh, query, key, value, attn_mask, is_causal)
        segments = _segments(attn_mask, query.shape[0], query.shape[2])[0]
        pattern = _mask_pattern(attn_mask, query.shape[2]) if attn_mask is not None and segments is None else None
        causal, window = pattern or (False, None)
        causal = causal or bool(is_causal) or segments is not None  # documents are causal within themselves
        return context_attention(
            query,
            key,
            value,
            mesh=mesh,
            axis=context.axis,
            causal=causal,
            scale=scale,
            gathered=context.attention == "all_gather",
            balanced=context.load_balance,
            segments=segments,
            rows=row_axes,
            window=window,
        )

    return sdpa


def _record_ring(context: ContextParallel, mesh: Mesh, query, key, value, attn_mask, is_causal) -> None:
    """The call site's kernel: the ring (or all-gather), which folds its own tiles whatever ``auto`` would pick.

    Raises:
        ArgumentError: a kernel other than ``auto`` or ``tiled`` was forced.
    """
    policy = kernels.current(mesh.devices.flat[0].platform)
    site = current_module()
    if policy.requested not in ("auto", "tiled"):
        raise ArgumentError(
            f"attention_kernel={policy.requested!r} cannot take the attention called by {site or 'the top level'} "
            f"(query {list(query.shape)}, key {list(key.shape)}): under {context} each device folds its part of the "
            f"sequence with the ring's own tiles, not a {policy.requested} kernel; use attention_kernel='auto'"
        )
    if policy.record is not None:
        policy.record.setdefault(site, kernels.Choice(context.attention, f"{context} over {describe_mesh(mesh)}"))


class ContextParallelWarning(UserWarning):
    """A step under `ContextParallel` calls no ``scaled_dot_product_attention``: no attention runs as a ring."""


_WARNED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models a ContextParallelWarning has named
_CALLS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("torchshard_sdpa_calls", default=None)


def _attention_of(model: torch.nn.Module) -> str:
    """The model, and for a transformers model its attention implementation and any logit softcapping."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is None:
        return type(model).__name__
    text = (
        f"{type(model).__name__} (model_type {getattr(config, 'model_type', '?')!r}, transformers' "
        f"attn_implementation={implementation!r}"
    )
    softcap = getattr(config, "attn_logit_softcapping", None)
    return text + (f", attn_logit_softcapping={softcap}, which SDPA cannot apply)" if softcap else ")")


def _warn_no_attention(context: ContextParallel, model: torch.nn.Module) -> None:
    if model in _WARNED:
        return
    _WARNED.add(model)
    warnings.warn(
        f"{_attention_of(model)} calls no scaled_dot_product_attention in its step, so {context} runs no ring "
        f"attention: GSPMD all-gathers the sequence for its own attention in every layer (every device holds all "
        f"keys and values and S×S scores per head, as without context parallelism; the other layers stay split). "
        f"Use an SDPA attention (transformers: attn_implementation='sdpa' where the family has it and computes the "
        f"same) to split the attention too, or train without context=",
        ContextParallelWarning,
        stacklevel=2,
    )


@contextlib.contextmanager
def tracing(
    context: ContextParallel, mesh: Mesh, row_axes: tuple[str, ...] = (), model: torch.nn.Module | None = None
) -> Iterator[None]:
    """While a step is traced: SDPA runs as context-parallel attention over ``context.axis``.

    A ``model`` whose trace calls no SDPA (an attention of its own: transformers' ``eager``
    attention, as Gemma2's) gets one `ContextParallelWarning`: its attention is not split.

    Lowerings that flatten tokens keep them split over ``row_axes`` (the batch's rows) and the
    context axis (`tokens.TokenLayout`): a linear layer's dot and the loss see each device's rows.

    Integer and boolean tensors that depend on no input (positions from ``arange``, masks built
    from them) are computed while tracing: transformers then sees concrete positions, finds no packed
    sequences and passes ``is_causal=True`` with no mask, as in eager torch (with traced positions it
    builds a ``[B, 1, S, S]`` mask), and a constant mask a model builds can be read and recognised.
    """
    outer = _CALLS.get()  # a step traced in parts (a 1F1B pipeline's) checks its parts' calls together
    calls: list[int] = outer if outer is not None else []
    sdpa = _sdpa(context, mesh, row_axes, calls)
    with contextlib.ExitStack() as stack:
        for op in ATTENTION_OPS:
            stack.enter_context(overriding(op, sdpa, jax_function=True))
        stack.enter_context(index_constants_folded())
        stack.enter_context(documents.as_segments())
        stack.enter_context(hf_documents.segments_from_position_ids())
        stack.enter_context(tokens.laid_out(tokens.TokenLayout(mesh.shape[context.axis], mesh, row_axes, context.axis)))
        token = _CALLS.set(calls)
        try:
            yield
        finally:
            _CALLS.reset(token)
    if outer is None and not calls and model is not None:
        _warn_no_attention(context, model)
