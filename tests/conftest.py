"""Test fixtures; the root conftest.py configures 8 simulated CPU devices before anything starts JAX's backend."""

import jax
import pytest

import torchshard

assert len(jax.devices()) == 8, jax.devices()


def pytest_ignore_collect(collection_path, config):
    """Skips the helper modules and launched scripts here: they hold no doctests, and --doctest-modules
    imported each in every worker (search_faults.py alone imports transformers' Llama: 3.5 s)."""
    if collection_path.suffix == ".py" and not collection_path.name.startswith(("test_", "conftest")):
        return True
    return None


@pytest.fixture
def mesh_dm():
    """data=4 × model=2, the mesh most tests use."""
    return torchshard.make_mesh({"data": 4, "model": 2})


@pytest.fixture
def mesh_fsdp():
    """data=8, for FSDP and pure data parallelism."""
    return torchshard.make_mesh({"data": 8})


@pytest.fixture
def fresh_probes():
    """Each test probes its fused kernels afresh, and leaves no verdict it injected behind."""
    from torchshard._bridge.env import env
    from torchshard._bridge.ops import probes

    env()
    probes.forget()
    yield
    probes.forget()


@pytest.fixture
def tokamax_installed(monkeypatch):
    """tokamax as if installed: for choices made without running it."""
    from torchshard._bridge.ops import tokamax_attention

    monkeypatch.setattr(tokamax_attention, "missing", lambda: None)
