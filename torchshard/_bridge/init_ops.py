"""torch-level replacements for what torchax gets wrong in the in-place ops ``torch.nn.init`` calls.

torchax 0.0.13 lowers ``aten.normal_`` as ``aten.normal(self, mean, std)``, a call no ``aten.normal``
overload accepts (``normal.Tensor_float`` takes two positional arguments), so every
``torch.nn.init.normal_`` fails under torchax (``RuntimeError: ... aten::normal()``); transformers'
``_init_weights`` calls it for every Linear and Embedding. Registered with
``Environment.override_op_definition``, these run with torchax tensors: the noise comes from
torchax's RNG (``torch.randn`` under the environment), so it is seeded like every other init.
"""

from __future__ import annotations

import torch

from torchshard._bridge.loaded import Environment


def normal_(
    self: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``aten.normal_``: fills ``self`` in place with samples of N(``mean``, ``std``²).

    Example:
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

    Example:
        >>> is_meta(torch.empty(2, device="meta"))
        False
    """
    return False


def install(tx: Environment) -> None:
    """Registers the ``aten.normal_`` replacement in ``tx`` (``is_meta`` only while `init_sharded` builds)."""
    tx.override_op_definition(torch.ops.aten.normal_, normal_)
