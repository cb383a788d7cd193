"""transformers' packed-sequence masks as document ids while a context-parallel step is traced.

transformers (5.x) reads packed rows from ``position_ids`` (no ``attention_mask``, no cache): it
finds each token's document (``find_packed_sequence_indices``), wraps the causal mask function
with ``packed_sequence_compatibility_function`` and has the ``"sdpa"`` mask interface build a
``[B, 1, S, S]`` mask from it. That mask is computed from the batch, so context-parallel attention
could not split it. Here the wrapped function keeps the document ids it was built from, and the
mask interface returns them (`documents.document_mask`'s integer form) when the mask is exactly
documents × causal; any other mask (sliding windows, padding, extra mask functions) is built as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class _Documents:
    """transformers' packed mask function, remembering the document ids ``[B, S]`` it compares."""

    function: Callable[..., Any]
    segments: torch.Tensor

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


def _compatibility(original: Callable[..., Any], causal: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(mask_function, position_ids, packed_sequence_mask):
        combined = original(mask_function, position_ids, packed_sequence_mask)
        return _Documents(combined, packed_sequence_mask) if mask_function is causal else combined

    return wrapped


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
        if isinstance(mask_function, _Documents) and plain and q_offset == 0 and kv_offset == 0:
            segments = mask_function.segments.expand(batch_size, -1)
            return segments.to(torch.int32).reshape(batch_size, 1, 1, q_length)
        return original(
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

    return sdpa_mask


@contextlib.contextmanager
def segments_from_position_ids() -> Iterator[None]:
    """Inside the block, transformers' sdpa masks of packed rows are document ids (nothing if it is not imported)."""
    masking: Any = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "packed_sequence_compatibility_function"):
        yield
        return
    interface, original = masking.ALL_MASK_ATTENTION_FUNCTIONS, masking.packed_sequence_compatibility_function
    local = dict(interface._local_mapping)  # private: the instance's overrides, restored as they were
    masking.packed_sequence_compatibility_function = _compatibility(original, masking.causal_mask_function)
    interface["sdpa"] = _mask_interface(interface["sdpa"])
    try:
        yield
    finally:
        masking.packed_sequence_compatibility_function = original
        interface._local_mapping.clear()
        interface._local_mapping.update(local)
