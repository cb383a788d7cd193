"""torch-level replacements for what torchax gets wrong in the in-place ops ``torch.nn.init`` calls.

torchax 0.0.13 lowers ``aten.normal_`` as ``aten.normal(self, mean, std)``, a call no ``aten.normal``
overload accepts (``normal.Tensor_float`` takes two positional arguments), so every
``torch.nn.init.normal_`` fails under torchax (``RuntimeError: ... aten::normal()``); transformers'
``_init_weights`` calls it for every Linear and Embedding. Registered with
``Environment.override_op_definition``, these run with torchax tensors: the noise comes from
torchax's RNG (``torch.randn`` under the environment), so it is seeded like every other init.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import torch

from torchshard._bridge.loaded import Environment


def normal_(
    self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``aten.normal_``: fills ``self`` in place with samples of N(``mean``, ``std``²).

    Examples:
        >>> normal_(torch.empty(3), mean=5.0, std=0.0)
        tensor([5., 5., 5.])
    """
    noise = torch.randn(self.shape, dtype=self.dtype, device=self.device, generator=generator)
    return self.copy_(noise * std + mean)


def is_meta(self: torch.Tensor) -> bool:
    """``Tensor.is_meta`` for torchax tensors: False, as they hold values (their torch storage is meta).

    ``torch.nn.init.trunc_normal_``, ``sparse_`` and ``dirac_`` return at once for a meta tensor, so
    under torchax they silently leave the tensor as it was. Register it only while ``init_sharded``
    builds the model: elsewhere torch may read ``is_meta`` to avoid touching storage.

    Examples:
        >>> is_meta(torch.empty(2, device="meta"))
        False
    """
    return False


def trunc_normal_(
    tensor: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``torch.nn.init.trunc_normal_`` for torchax tensors: N(``mean``, ``std``²) truncated to [``a``, ``b``].

    torch 2.13 samples by rejection, looping until no value is out of bounds: a Python loop on
    tensor values, which a traced build cannot run. JAX's ``truncated_normal`` draws from the same
    distribution by inverting its CDF, from torchax's RNG (seeded like every other init). As in
    torch, the bounds are cast to the tensor's dtype, so every value lies within them there too.

    Examples:
        >>> from torchshard._bridge.env import env
        >>> with env():
        ...     w = trunc_normal_(torch.empty(1000, device="jax"), std=2.0, a=-1.0, b=1.0)
        ...     bool((w.abs() <= 1).all())
        True
    """
    if (mean < a - 2 * std) or (mean > b + 2 * std):  # torch's own warning, word for word
        warnings.warn(
            "mean is more than 2 std from [a, b] in nn.init.trunc_normal_. "
            "The distribution of values may be incorrect.",
            stacklevel=2,
        )
    env = tensor._env  # type: ignore[attr-defined]  # a torchax tensor or view
    key = env.get_and_rotate_prng_key(generator)
    held = jnp.dtype(jnp.float32) if jnp.dtype(tensor.jax().dtype).itemsize < 4 else tensor.jax().dtype  # type: ignore[attr-defined]
    z = jax.random.truncated_normal(key, (a - mean) / std, (b - mean) / std, tuple(tensor.shape), held)
    values = (mean + std * z).astype(tensor.jax().dtype)  # type: ignore[attr-defined]
    bounds = jnp.asarray(a, values.dtype), jnp.asarray(b, values.dtype)
    with torch.no_grad():
        return tensor.copy_(env.j2t_iso(jnp.clip(values, *bounds)))


def install(tx: Environment) -> None:
    """Registers the ``aten.normal_`` replacement in ``tx`` (``is_meta`` only while `init_sharded` builds)."""
    tx.override_op_definition(torch.ops.aten.normal_, normal_)
