"""Doctest setup: the same 8 simulated CPU devices as the tests, and the names docstring examples use."""

import pytest

import torchshard

torchshard.use_cpu_devices(8)


@pytest.fixture(autouse=True, scope="session")
def _doctest_names(doctest_namespace):
    """Docstring examples may use ``torch``, ``jax``, ``np``, ``P`` and ``ts`` without importing them."""
    import jax
    import numpy as np
    import torch
    from jax.sharding import PartitionSpec

    doctest_namespace.update(torch=torch, jax=jax, np=np, P=PartitionSpec, ts=torchshard)
