"""Packed documents: segment ids from position ids, and the document-causal mask a model passes to SDPA."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import numpy as np
import torch

from torchshard._base.validate import raise_for_arguments

# inside a context-parallel trace, `document_mask` hands SDPA the segment ids themselves (see `as_segments`)
_AS_SEGMENTS: contextvars.ContextVar[bool] = contextvars.ContextVar("torchshard_documents_as_segments", default=False)


@contextlib.contextmanager
def as_segments() -> Iterator[None]:
    """Inside the block `document_mask` returns int32 segment ids ``[B, 1, 1, S]`` instead of a ``[B, 1, S, S]`` mask.

    Context-parallel attention reads an integer ``attn_mask`` as segment ids (torch's SDPA takes
    only bool and float masks, so it cannot mean anything else): O(S) ids travel with their keys
    where an S×S mask could not be split.
    """
    token = _AS_SEGMENTS.set(True)
    try:
        yield
    finally:
        _AS_SEGMENTS.reset(token)


def _is_concrete(x: torch.Tensor) -> bool:
    value = x.jax() if hasattr(x, "jax") else x
    return not isinstance(value, jax.core.Tracer)


def _position_problems(position_ids: torch.Tensor) -> list[str]:
    if not isinstance(position_ids, torch.Tensor):
        return [
            f"position_ids must be an integer torch.Tensor of shape [batch, seq] or [seq], got "
            f"{type(position_ids).__name__} {' '.join(repr(position_ids).split()):.60}; pass "
            f"torch.as_tensor(position_ids)"
        ]
    where = f"position_ids {tuple(position_ids.shape)} {position_ids.dtype}"
    if position_ids.ndim not in (1, 2) or position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        return [f"{where}: needs integer positions of shape [batch, seq] or [seq]"]
    if position_ids.shape[-1] == 0:
        return [f"{where}: a row needs at least one token (seq is 0)"]
    if not _is_concrete(position_ids):
        return []  # traced: the values are checked where they are known (eagerly, or the batch before the step)
    values = np.asarray(position_ids.jax() if hasattr(position_ids, "jax") else position_ids.cpu()).reshape(
        -1, position_ids.shape[-1]
    )
    problems = [f"{where}: row {r} has negative positions" for r in range(len(values)) if (values[r] < 0).any()]
    bad = (values[:, 1:] != values[:, :-1] + 1) & (values[:, 1:] != 0)
    for r, t in zip(*np.nonzero(bad), strict=True):
        problems.append(
            f"{where}: row {r}, token {t + 1}: position {values[r, t + 1]} after {values[r, t]} neither continues "
            f"its document (+1) nor starts a new one (0)"
        )
        if len(problems) >= 5:
            break
    return problems


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids ``[B, S]`` (0, 1, ... along each row) of packed rows: a document starts where positions restart.

    A token starts a new document where its position does not continue the previous one by 1
    (transformers' ``find_packed_sequence_indices``); the first token of a row starts document 0.

    Examples:
        >>> segment_ids(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist()
        [[0, 0, 0, 1, 1, 2]]
    """
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    starts = torch.cat([torch.zeros_like(pos[:, :1]), (pos[:, 1:] != pos[:, :-1] + 1).to(pos.dtype)], dim=1)
    return torch.cumsum(starts, dim=1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The document-causal attention mask of packed rows, for ``F.scaled_dot_product_attention(attn_mask=...)``.

    Rows pack several documents, each with positions counting from 0 (transformers' convention for
    packed batches: ``DataCollatorWithFlattening``). A query sees the keys of its own document up to
    itself. In eager torch and under a Trainer it is a bool ``[B, 1, S, S]`` mask; while a
    ``ContextParallel`` step is traced it is the document ids ``[B, 1, 1, S]`` (int32), which the
    context-parallel attention reads as documents. Pass it to SDPA unchanged.

    Args:
        position_ids: integer ``[B, S]`` (or ``[S]``) positions: each token either continues its
            document (previous + 1) or starts one (0); a row's first token may continue a
            document from the previous row at any position.

    Returns:
        The mask (``True``: attend), broadcastable over the heads.

    Raises:
        ArgumentError: positions that are not an integer tensor of rank 1 or 2 (a list or numpy
            array included), an empty sequence, negative positions, or positions that jump to
            anything but 0 (values checked where they are known, not inside a traced step).

    Examples:
        >>> mask = document_mask(torch.tensor([[0, 1, 0, 1]]))
        >>> mask[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    raise_for_arguments(_position_problems(position_ids), header="invalid document_mask() position_ids")
    seg = segment_ids(position_ids)
    b, s = seg.shape
    if _AS_SEGMENTS.get():
        return seg.to(torch.int32).reshape(b, 1, 1, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=seg.device).tril()
    return (seg[:, None, :, None] == seg[:, None, None, :]) & causal
