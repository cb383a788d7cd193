"""tokamax's ``dot_product_attention`` (openxla's kernel library) on torch's SDPA layout, one implementation at a time.

tokamax is imported only when its kernel is asked for: it needs Python >= 3.12 and jax >= 0.11.1, so on
older stacks ``attention_kernel="tokamax"`` is refused by name (`kernels.check_kernel`) instead.
"""

from __future__ import annotations

import functools
import platform
from typing import Any

import jax

from torchshard._bridge.ops.fused import torch_layout

# tokamax's own order, fastest first: Mosaic GPU (Hopper/Blackwell), Pallas Triton, cuDNN, and XLA (anywhere)
IMPLEMENTATIONS = ("mosaic", "triton", "cudnn", "xla")
PALLAS = ("mosaic", "triton")  # one device's program each: GSPMD cannot split them
NEEDS = "tokamax needs Python >= 3.12 and jax >= 0.11.1"


@functools.cache
def missing() -> str | None:
    """Why tokamax cannot be imported here (with what it needs and how to get it), or None where it can.

    Examples:
        >>> missing() is None or "pip install tokamax" in missing()
        True
    """
    try:
        import tokamax  # noqa: F401
    except ImportError as err:  # not installed, or built for another jax
        here = f"this is Python {platform.python_version()} with jax {jax.__version__}"
        return f"tokamax cannot be imported ({type(err).__name__}: {err}); {NEEDS} ({here}): pip install tokamax"
    return None


def attend(implementation: str, query, key, value, attn_mask, is_causal, scale) -> Any:
    """``tokamax.dot_product_attention(implementation=implementation)`` on torch's [b, heads, s, d] layout.

    tokamax groups query heads over KV heads as torch's ``enable_gqa`` does (head ``n`` reads KV head
    ``n // group``), aligns a causal mask top-left as torch does, and takes values narrower than queries.
    A row that sees no key gets zeros, as in torch (`fused.torch_layout`).

    Args:
        implementation: one of `IMPLEMENTATIONS`; tokamax raises ``NotImplementedError`` while tracing
            where that implementation cannot take the call.
        query: [b, heads, s, d].
        key: [b, kv_heads, t, d].
        value: [b, kv_heads, t, dv].
        attn_mask: a boolean mask or additive bias broadcastable to [b, heads, s, t], or None.
        is_causal: torch's top-left causal mask.
        scale: the score scale (default ``d ** -0.5``).
    """
    import tokamax

    fn = functools.partial(tokamax.dot_product_attention, implementation=implementation)
    return torch_layout(fn, query, key, value, attn_mask, is_causal, scale)
