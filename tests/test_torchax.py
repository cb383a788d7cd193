"""The torchax bridge: importing torchshard is silent and starts nothing; wrapping and host dtypes round-trip."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchshard._bridge.tensors import host_array, is_jax_tensor, jax_dtype, to_torch, unwrap, wrap


def test_import_prints_nothing_and_leaves_the_backend_alone():
    code = "import torchshard\nfrom jax._src import xla_bridge\nassert not xla_bridge._backends, xla_bridge._backends\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert done.stderr == ""


@pytest.mark.parametrize(
    ("dtype", "held"),
    [
        (torch.float32, np.float32),
        (torch.bfloat16, jnp.bfloat16),
        (torch.int64, np.int32),  # x64 is off: JAX holds 64-bit values in 32 bits
        (torch.float64, np.float32),
        (torch.bool, np.bool_),
    ],
)
def test_host_dtypes_and_round_trip(dtype, held):
    t = (torch.arange(6) % 2).to(dtype).reshape(2, 3)
    assert host_array(t).dtype == np.dtype(held)
    assert jax_dtype(dtype) == np.dtype(held)
    back = to_torch(np.asarray(jnp.asarray(host_array(t))), dtype)
    assert back.dtype == dtype
    torch.testing.assert_close(back, t)


def test_wrap_and_unwrap_share_the_array():
    array = jnp.arange(4.0)
    tensor = wrap(array)
    assert is_jax_tensor(tensor) and not is_jax_tensor(torch.zeros(1))
    assert unwrap(tensor) is array
    assert unwrap(3) == 3
