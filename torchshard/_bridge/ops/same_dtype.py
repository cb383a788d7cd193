"""Matrix products refuse an integer operand beside a floating one, as torch does (JAX would promote)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import torch

from torchshard._base.errors import ShardingError
from torchshard._bridge.loaded import Environment
from torchshard._bridge.registry import register

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


def install(tx: Environment) -> None:
    """Wraps the lowering each op has in ``tx`` now (install it after the others)."""
    for op, (name, positions) in SAME_DTYPE.items():
        impl = tx._ops[op].func  # a JAX-level lowering (torchax's or one of torchshard's)
        register(tx, op, same_dtype_kind(name, positions, impl), jax_function=True, needs_env=False)
