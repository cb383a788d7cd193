"""Test fixtures; the root conftest.py configures 8 simulated CPU devices before anything starts JAX's backend."""

import jax
import pytest

import torchshard

assert len(jax.devices()) == 8, jax.devices()


@pytest.fixture
def mesh_dm():
    """data=4 × model=2, the mesh most tests use."""
    return torchshard.make_mesh({"data": 4, "model": 2})


@pytest.fixture
def mesh_fsdp():
    """data=8, for FSDP and pure data parallelism."""
    return torchshard.make_mesh({"data": 8})
