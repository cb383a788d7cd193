"""torch-level replacements for torchax's lowerings of the in-place random ops that ``torch.nn.init`` calls.

torchax 0.0.13 lowers ``aten.normal_`` as ``aten.normal(self, mean, std)``, a call no ``aten.normal``
overload accepts (``normal.Tensor_float`` takes two positional arguments), so every
``torch.nn.init.normal_`` fails under torchax (``RuntimeError: ... aten::normal()``); transformers'
``_init_weights`` calls it for every Linear and Embedding. Registered with
``Environment.override_op_definition``, these run with torchax tensors: the noise comes from
torchax's RNG (``torch.randn`` under the environment), so it is seeded like every other init.
"""

from __future__ import annotations

import torch


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
