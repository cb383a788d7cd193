"""``torch.autocast`` regions honoured by torchax tensors, through torchax's own autocast policy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchshard._bridge.loaded import Environment, amp

_AUTOCAST_DEVICES = ("cpu", "cuda")
# torch-level functions torchax lowers whole, so its aten-level autocast table never sees them
_AUTOCAST_LOWER = (
    torch.nn.functional.linear,
    torch.nn.functional.scaled_dot_product_attention,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.bmm,
    torch.mm,
)


def torch_autocast_dtype() -> torch.dtype | None:
    """The dtype of an enclosing ``torch.autocast`` region (any device type), or None outside one."""
    for device in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


def _honouring_torch_autocast(tx: Environment, dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` that applies torchax's autocast policy inside ``torch.autocast`` regions.

    torch's autocast lives in dispatch keys that torchax tensors never reach, so without this a
    ``torch.autocast`` block in user code would silently change nothing.
    """

    def autocast_dispatch(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        dtype = torch_autocast_dtype() if tx.param.autocast_dtype is None else None
        if dtype is None:
            return dispatch(func, types, args, kwargs)
        if func in _AUTOCAST_LOWER:
            with tx:
                args, kwargs = amp.execute_policy(amp.CastPolicy.LOWER_PRECISION_FP, args, kwargs or {}, dtype)
        with tx.override_property(autocast_dtype=dtype):
            return dispatch(func, types, args, kwargs)

    return autocast_dispatch


def install(tx: Environment) -> None:
    """Wraps ``tx``'s dispatch so ``torch.autocast`` regions take effect."""
    tx.dispatch = _honouring_torch_autocast(tx, tx.dispatch)
