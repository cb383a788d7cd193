"""The torchax bridge: importing torchshard is silent and starts nothing; wrapping and host dtypes round-trip."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchax.interop

from testsupport.helpers import fresh_process
from torchshard._bridge.env import env
from torchshard._bridge.tensors import host_array, is_jax_tensor, jax_dtype, to_torch, unwrap, wrap


@pytest.mark.slow
@pytest.mark.compat
def test_import_prints_nothing_and_leaves_the_backend_alone():
    fresh = fresh_process()
    assert fresh["returncode"] == 0, fresh["stderr"]
    assert fresh["backends_after_import"] == []
    assert fresh["import_stdout"] == ""
    assert fresh["import_stderr"] == ""


@pytest.mark.parametrize(
    ("dtype", "held"),
    [
        (torch.float32, np.float32),
        (torch.bfloat16, jnp.bfloat16),
        (torch.int64, np.int32),  # x64 is off: JAX holds 64-bit values in 32 bits
        (torch.float64, np.float32),
        (torch.bool, np.bool_),
        (torch.complex128, np.complex64),
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


# torch calls that ask for int64 (or float64 / complex128), as model code makes them inside a step
WIDE = {
    "arange": lambda x: torch.arange(4, dtype=torch.long),
    "zeros": lambda x: torch.zeros(3, dtype=torch.int64),
    "full": lambda x: torch.full((2,), 7, dtype=torch.long),
    "empty_like": lambda x: torch.empty_like(x, dtype=torch.long).fill_(1),
    "new_zeros": lambda x: x.new_zeros(3, dtype=torch.long),
    "ones_like": lambda x: torch.ones_like(x, dtype=torch.long),
    "tensor_dtype": lambda x: torch.tensor(8, dtype=torch.long),  # transformers' sliding-window cache
    "tensor_int": lambda x: torch.tensor([1, 2]),
    "long": lambda x: (x * 3).long(),
    "to_int64": lambda x: (x * 3).to(torch.int64),
    "cumsum": lambda x: x.cumsum(0, dtype=torch.int64),
    "max_dim": lambda x: x.reshape(2, 2).max(1).indices,
    "min_dim_keepdim": lambda x: x.reshape(2, 2).min(0, keepdim=True).indices,
    "one_hot": lambda x: torch.nn.functional.one_hot((x * 3).long(), 4),
    "div_floor": lambda x: torch.div((x * 7).long(), 2, rounding_mode="floor"),
    "div_trunc": lambda x: torch.div(-(x * 7).long(), 2, rounding_mode="trunc"),
    "bucketize": lambda x: torch.bucketize(x, torch.tensor([0.0, 0.5])),
    "double": lambda x: x.double() * 2,
    "complex128": lambda x: x.to(torch.complex128),
}


@pytest.mark.parametrize("name", WIDE)
def test_64_bit_requests_are_held_narrowed_without_a_warning_per_call(name):
    """JAX warned "Explicitly requested dtype int64 ... truncated to int32" at every such call of every step."""
    x = torch.linspace(0.0, 1.0, 4)
    expected = WIDE[name](x)
    traced = torchax.interop.jax_jit(lambda t: WIDE[name](t))
    with env(), torch.device("jax"):  # the Trainer's step traces under both
        got = traced(x.to("jax"))
    assert np.dtype(got.jax().dtype) == jax_dtype(expected.dtype)
    np.testing.assert_array_equal(np.asarray(got.jax()), expected.numpy().astype(jax_dtype(expected.dtype)))


@pytest.mark.compat
def test_a_threads_first_rng_key_is_made_eagerly_even_when_first_read_inside_a_trace():
    """torchax keeps one RNG key per thread, made when the thread first reads the environment; jax >= 0.11 stages
    even a constant key inside a trace, so a first read there left that trace's tracer as the thread's key (the
    pipelined ``plan --compile`` report did, and every later random draw failed)."""
    env()
    keys: dict[str, object] = {}

    def thread() -> None:
        @jax.jit
        def traced(x):
            keys["inside"] = env().param.prng
            return x

        traced(1.0)
        keys["after"] = env().param.prng

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join()
    assert not isinstance(keys["inside"], jax.core.Tracer)
    assert not isinstance(keys["after"], jax.core.Tracer)
