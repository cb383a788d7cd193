"""``Tensor.copy_`` under torchax equals eager torch: from and into views, broadcast, cast, from CPU tensors."""

import jax
import numpy as np
import pytest
import torch

from torchshard._bridge.env import env
from torchshard._bridge.tensors import unwrap, wrap


def _pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)


# each case: f(a, b) -> the tensor copy_ wrote; a and b are [4, 3], plain torch or torchax tensors
CASES = {
    # xLSTM's chunked inference: a cache tensor copy_'s a state that is a view
    "tensor from a row view": lambda a, b: torch.zeros(3).copy_(b[1]),
    "bfloat16 tensor from a view (cast)": lambda a, b: torch.zeros(3, dtype=torch.bfloat16).copy_(b[1]),
    "tensor from a sliced view": lambda a, b: torch.zeros(2, 3).copy_(b[1:3]),
    "tensor from a view of a view": lambda a, b: torch.zeros(2).copy_(b[1:3][:, 0]),
    "a row broadcast over a tensor": lambda a, b: a.copy_(b[1].clone()),
    "a row view broadcast over a tensor": lambda a, b: a.copy_(b[2]),
    "a scalar into a one-element tensor": lambda a, b: torch.zeros(1).copy_(b[0, 0].clone()),
    "a transposed tensor": lambda a, b: torch.zeros(3, 4).copy_(b.t()),
    "a CPU tensor": lambda a, b: a.copy_(torch.arange(12.0).reshape(4, 3)),
    "a view from a view (written back)": lambda a, b: (a[1:3].copy_(b[0:2]), a)[1],
    "a view from a bfloat16 tensor (cast, written back)": lambda a, b: (a[0].copy_(b[3].bfloat16()), a)[1],
    "a bfloat16 view from a float32 tensor": lambda a, b: (lambda c: (c[1].copy_(b[2].clone()), c)[1])(a.bfloat16()),
    "a view broadcast from a scalar tensor": lambda a, b: (a[:, 1].copy_(b[0, 0].clone()), a)[1],
    "integers into floats": lambda a, b: a.copy_(torch.arange(3)),
}


def _eager(case) -> torch.Tensor:
    return case(*_pair())


def _torchax(case) -> tuple[np.ndarray, torch.dtype, tuple[int, ...]]:
    a, b = _pair()
    with env(), torch.device("jax"):
        out = case(a.to("jax"), b.to("jax"))
        return np.asarray(out.jax().astype("float32")), out.dtype, tuple(out.shape)


@pytest.mark.parametrize("name", CASES)
def test_copy_equals_eager_torch(name):
    expected = _eager(CASES[name])
    values, dtype, shape = _torchax(CASES[name])
    assert (shape, dtype) == (tuple(expected.shape), expected.dtype)
    np.testing.assert_array_equal(values, expected.float().numpy())


def test_copy_from_a_view_traces_under_jit():
    def fn(x: jax.Array) -> jax.Array:
        with env(), torch.device("jax"):
            state = torch.zeros(2, 3, dtype=torch.bfloat16)
            state.copy_(wrap(x)[1:3])
            return unwrap(state)

    _, b = _pair()
    got = jax.jit(fn)(jax.numpy.asarray(b.numpy()))
    np.testing.assert_array_equal(np.asarray(got.astype("float32")), b[1:3].bfloat16().float().numpy())
