"""transformers' packed-sequence masks as document ids while a context-parallel step is traced.

transformers (5.x) reads packed rows from ``position_ids`` (no ``attention_mask``, no cache): it
finds each token's document (``find_packed_sequence_indices``), wraps the causal mask function
with ``packed_sequence_compatibility_function`` (5.23; other releases ``and_masks`` it with
``packed_sequence_mask_function``, ≥ 5.24 after ``remap_positions_for_packed_sequence``) and has
the ``"sdpa"`` mask interface build a ``[B, 1, S, S]`` mask from it. That mask is computed from the
batch, so context-parallel attention could not split it. Here the wrapped function keeps the
document ids it was built from, and the mask interface returns them (`documents.document_mask`'s
integer form) when the mask is exactly documents × causal; any other mask (sliding windows,
padding, extra mask functions) is built as before,
and what it was built from is kept for the refusal that names it (`built_from`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import torch

from torchshard._bridge.tensors import unwrap

# what each traced mask the interface built in this step came from, by (dtype, shape)
_BUILT: contextvars.ContextVar[dict[tuple[str, tuple[int, ...]], set[tuple[str, str]]] | None] = contextvars.ContextVar(
    "torchshard_hf_masks", default=None
)


@dataclasses.dataclass(frozen=True)
class _Documents:
    """transformers' packed mask function, remembering the document ids ``[B, S]`` it compares, and whether the
    function it made packed was plain causal."""

    function: Callable[..., Any]
    segments: torch.Tensor
    causal: bool

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


def _compatibility(original: Callable[..., Any], causal: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(mask_function, position_ids, packed_sequence_mask):
        combined = original(mask_function, position_ids, packed_sequence_mask)
        return _Documents(combined, packed_sequence_mask, mask_function is causal)

    return wrapped


@dataclasses.dataclass(frozen=True)
class _Made:
    """A mask function transformers made, remembering what from: the document ids ``[B, S]`` it compares
    (``packed_sequence_mask_function``) or the function whose positions it remaps to each document's own
    (``remap_positions_for_packed_sequence``, transformers ≥ 5.24)."""

    function: Callable[..., Any]
    segments: torch.Tensor | None = None
    remapped: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


def _and_masks(original: Callable[..., Any], causal: Callable[..., Any]) -> Callable[..., Any]:
    """``and_masks``, whose result for a mask function and the packed documents is `_Documents`: transformers other
    than 5.23 packs by ``and_masks(function, packed_sequence_mask_function(ids))`` (≥ 5.24: the function remapped)."""

    def wrapped(*mask_functions):
        combined = original(*mask_functions)
        last = mask_functions[-1] if mask_functions else None
        if not isinstance(last, _Made) or last.segments is None:
            return combined
        first = mask_functions[0]
        base = first.remapped if isinstance(first, _Made) and first.remapped is not None else first
        return _Documents(combined, last.segments, len(mask_functions) == 2 and base is causal)

    return wrapped


def _packing_hooks(masking: Any) -> dict[str, Callable[..., Any]]:
    """What to replace in ``masking`` (transformers.masking_utils) so packed masks keep their document ids."""
    causal = masking.causal_mask_function
    if compatibility := getattr(masking, "packed_sequence_compatibility_function", None):  # transformers 5.23
        return {"packed_sequence_compatibility_function": _compatibility(compatibility, causal)}
    segments = masking.packed_sequence_mask_function
    hooks: dict[str, Callable[..., Any]] = {
        "packed_sequence_mask_function": lambda ids: _Made(segments(ids), segments=ids),
        "and_masks": _and_masks(masking.and_masks, causal),
    }
    if remap := getattr(masking, "remap_positions_for_packed_sequence", None):  # transformers ≥ 5.24
        hooks["remap_positions_for_packed_sequence"] = lambda function, ids: _Made(
            remap(function, ids), remapped=function
        )
    return hooks


def _sources(mask_function: Any, attention_mask: Any, local_size: Any) -> tuple[str, str]:
    """What transformers builds a mask from, in words, and the way to a mask context parallelism reads."""
    parts, packed = [], isinstance(mask_function, _Documents)
    if attention_mask is not None:
        parts.append(
            f"a 2-D attention_mask {str(attention_mask.dtype).removeprefix('torch.')}"
            f"{list(attention_mask.shape)} (padding, from the batch or the model)"
        )
    if packed:
        parts.append("the batch's position_ids (packed documents)")
        if not mask_function.causal and local_size is None:
            parts.append("a mask function other than plain causal (the model's own and/or masks)")
    if local_size is not None:
        parts.append(
            f"a sliding window or chunks of {local_size} tokens (config.sliding_window or attention_chunk_size)"
        )
    fix = (
        "it reads packed documents only under a plain causal mask, and a window only as a constant band: train "
        "these rows unpacked (positions 0, 1, ... in each row), or without context="
        if packed
        else "train without an attention_mask (unpadded rows), or without context="
    )
    return f"transformers built it from {' and '.join(parts) or 'its mask function'}", fix


def built_from(mask: Any) -> tuple[str, str] | None:
    """What transformers built a traced ``mask`` (a jax array) from in this step, and how to avoid it; None when
    its mask interface built no traced mask of that dtype and shape in this step."""
    found = (_BUILT.get() or {}).get((str(mask.dtype), tuple(mask.shape)))
    if not found:
        return None
    return " / ".join(sorted(s for s, _ in found)), " / ".join(sorted({f for _, f in found}))


def _mask_interface(original: Callable[..., Any]) -> Callable[..., Any]:
    def sdpa_mask(
        *,
        batch_size,
        q_length,
        kv_length,
        q_offset=0,
        kv_offset=0,
        mask_function=None,
        attention_mask=None,
        local_size=None,
        **kwargs,
    ):
        plain = attention_mask is None and local_size is None and q_length == kv_length
        if isinstance(mask_function, _Documents) and mask_function.causal and plain and q_offset == 0 == kv_offset:
            segments = mask_function.segments.expand(batch_size, -1)
            return segments.to(torch.int32).reshape(batch_size, 1, 1, q_length)
        built = original(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            **kwargs,
        )
        _remember(built, _sources(mask_function, attention_mask, local_size))
        return built

    return sdpa_mask


def _remember(mask: Any, sources: tuple[str, str]) -> None:
    """Keeps ``sources`` for a mask that is traced (a constant mask is read, not refused)."""
    known = _BUILT.get()
    if known is not None and isinstance(unwrap(mask), jax.core.Tracer):
        key = (str(mask.dtype).removeprefix("torch."), tuple(mask.shape))
        known.setdefault(key, set()).add(sources)


@contextlib.contextmanager
def segments_from_position_ids() -> Iterator[None]:
    """Inside the block, transformers' sdpa masks of packed rows are document ids (nothing if it is not imported)."""
    masking: Any = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    hooks = _packing_hooks(masking)
    interface, originals = masking.ALL_MASK_ATTENTION_FUNCTIONS, {name: getattr(masking, name) for name in hooks}
    local = dict(interface._local_mapping)  # private: the instance's overrides, restored as they were
    for name, hook in hooks.items():
        setattr(masking, name, hook)
    interface["sdpa"] = _mask_interface(interface["sdpa"])
    token = _BUILT.set({})
    try:
        yield
    finally:
        _BUILT.reset(token)
        for name, original in originals.items():
            setattr(masking, name, original)
        interface._local_mapping.clear()
        interface._local_mapping.update(local)
