"""torchax's ``copy_`` cannot read a view and does not broadcast: torch's ``copy_`` into any torchax tensor.

torchax (0.0.13, and google/torchax main at 30cbac2) lowers ``aten.copy_`` as a view op, so its
arguments reach the lowering unmaterialised, and then reads ``source._elem``, which a
``torchax.view.View`` (what ``t[basic index]`` returns) does not have: ``x.copy_(y[0])`` raised
"AttributeError: 'View' object has no attribute '_elem'". xLSTM's chunked inference
(``max_inference_chunksize`` shorter than the sequence) copies each chunk's recurrent state into
its cache so, which stopped `Trainer.evaluate` on long sequences. The same lowering replaced a
tensor by a smaller ``source`` instead of broadcasting it (``x.copy_(row)`` left ``x`` a row), and
cast into a view through a JAX scatter that warns it will refuse the cast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchshard._bridge.init_views import write
from torchshard._bridge.loaded import Environment, Tensor, View
from torchshard._bridge.versions import Gate
from torchshard._bridge.view_infos import is_ours

COPY_FROM_VIEWS = Gate("torchax ops/jaten.py _aten_copy reads source._elem, which a View lacks", (0, 0, 14))


def _broadcasts(source: Sequence[int], dest: Sequence[int]) -> bool:
    """Whether torch broadcasts a ``source``-shaped tensor to ``dest``'s shape.

    Examples:
        >>> _broadcasts((3,), (4, 3)), _broadcasts((4, 1), (4, 3)), _broadcasts((1, 4, 3), (4, 3))
        (True, True, False)
    """
    trailing = dest[len(dest) - len(source) :]
    return len(source) <= len(dest) and all(s in (1, d) for s, d in zip(source, trailing, strict=True))


def copy_(dest: Any, source: Any, non_blocking: bool = False) -> Any:
    """``aten.copy_``: ``source`` (a tensor, a view or a CPU tensor) cast to ``dest``'s dtype and shape."""
    if isinstance(source, torch.Tensor) and not is_ours(source):  # a CPU tensor: moved, as torch would
        source = Tensor(dest._env.t2j_copy(source), dest._env)
    if isinstance(dest, View) or _broadcasts(tuple(source.shape), tuple(dest.shape)):
        write(dest, source)
    else:
        # torchax's own in-place ops may grow a tensor so (its reference attention masked_fill_'s a [L, S] bias by
        # a batched mask, then copy_'s the [B, L, S] result back): keep its replacement where torch would refuse
        dest._elem = source.jax().astype(dest._elem.dtype)
    return dest


def install(tx: Environment) -> None:
    """Replaces ``aten.copy_`` in ``tx`` when the installed torchax has the bug.

    A view op to torchax, so that the views it writes into and reads from arrive as views.
    """
    if COPY_FROM_VIEWS.applies():
        tx.override_op_definition(torch.ops.aten.copy_, copy_, is_view_op=True)
