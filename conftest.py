"""Setup for tests and doctests: fast-compiling XLA flags, 8 simulated CPU devices, the names docstring examples use."""

import os

import pytest

# The suite compiles hundreds of tiny steps and runs each a few times, so XLA's CPU compiler is most
# of its time. Without LLVM optimisation and with XLA's older CPU fusion emitters it compiles ~40%
# faster. The HLO passes (sharding, collectives, buffer assignment) stay the same, so the tests check
# the same things: on a 4-layer Llama step, losses agree to 1e-7 and compiled temp memory to 128 bytes
# in 1.3 MB. Subprocesses the tests launch inherit the flags. Users, and benchmarks run by hand,
# keep XLA's defaults; TORCHSHARD_TEST_XLA_DEFAULTS=1 runs the tests with them too.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if not os.environ.get("TORCHSHARD_TEST_XLA_DEFAULTS"):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import torchshard  # noqa: E402

torchshard.use_cpu_devices(8)


@pytest.fixture(autouse=True, scope="session")
def _doctest_names(doctest_namespace):
    """Docstring examples may use ``torch``, ``jax``, ``np``, ``P`` and ``ts`` without importing them."""
    import jax
    import numpy as np
    import torch
    from jax.sharding import PartitionSpec

    doctest_namespace.update(torch=torch, jax=jax, np=np, P=PartitionSpec, ts=torchshard)
