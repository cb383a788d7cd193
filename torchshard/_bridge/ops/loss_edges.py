"""What a class-index loss does at its edges: a mean over no valid token, and a label outside the classes."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp


def mean_over_valid(total: jax.Array, valid: jax.Array, reduction: Literal["mean", "sum"]) -> jax.Array:
    """``total`` over the count of ``valid`` tokens (``"mean"``) or as it is (``"sum"``).

    With no valid token the mean is nan and its gradients 0, as eager torch's: dividing by the
    count would send 1/0 back, and 0 × inf is nan in every parameter.

    Examples:
        >>> f = lambda t: mean_over_valid(t, jnp.zeros(3, bool), "mean")
        >>> float(f(jnp.float32(0))), float(jax.grad(f)(jnp.float32(0)))
        (nan, 0.0)
    """
    if reduction != "mean":
        return total
    count = jnp.sum(valid)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)


def out_of_range_nan(labels: jax.Array, ignore_index: int, vocab: int) -> jax.Array:
    """1, or nan where a label that is not ``ignore_index`` lies outside ``[0, vocab)``: a factor of the loss.

    Eager torch raises there; a compiled step cannot, and a gather would clamp the label to a finite,
    wrong loss. So the loss and every gradient are nan: the step is visibly broken, and
    ``Trainer(skip_nonfinite=True)`` skips it without changing a parameter.

    Examples:
        >>> [float(out_of_range_nan(jnp.array(y), -100, 5)) for y in ([0, 4, -100], [0, 5], [-1])]
        [1.0, nan, nan]
    """
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    return jnp.where(jnp.any(bad), jnp.float32(jnp.nan), jnp.float32(1))
