"""Test setup: 8 simulated CPU devices, configured before anything starts JAX's backend."""

import torchshard

torchshard.use_cpu_devices(8)

import jax  # noqa: E402
import pytest  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()


@pytest.fixture
def mesh_dm():
    """data=4 × model=2, the mesh most tests use."""
    return torchshard.make_mesh({"data": 4, "model": 2})


@pytest.fixture
def mesh_fsdp():
    """data=8, for FSDP and pure data parallelism."""
    return torchshard.make_mesh({"data": 8})
