"""torch ops of mixture-of-experts layers lowered to JAX (transformers' grouped_mm experts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def jax_lowerings() -> dict[Any, Callable[..., Any]]:
    """torch callables → JAX implementations (they take and return jax arrays)."""
    return {}
