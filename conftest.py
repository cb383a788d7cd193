"""Setup for tests and doctests: fast-compiling XLA flags, 8 simulated CPU devices, the names docstring examples use."""

import os
import subprocess
import sys

import pytest

# The suite compiles hundreds of tiny steps and runs each a few times, so XLA's CPU compiler is most
# of its time. Without LLVM optimisation it compiles faster (with XLA's older CPU fusion emitters too it
# was ~40% faster; jaxlib 0.11.2, every tested lane's, no longer has that flag: the suite took 16:54 on it
# against 10:50 on jaxlib 0.10.2, the flag's loss not measured apart from the rest of the stack's move).
# The HLO passes (sharding, collectives, buffer assignment) stay the same, so the tests check the same
# things: on a 4-layer Llama step, losses agree to 1e-7 and
# compiled temp memory to 128 bytes in 1.3 MB. One exception is known: xLSTM's third AdamW step is NaN
# without LLVM optimisation and equals eager torch with XLA's defaults, so the conformance matrix runs
# it with the defaults (tools/families.py, XLA_DEFAULTS). The third flag compiles each program's LLVM code as one
# unit instead of splitting it over threads: on 2 cores both pytest workers already hold them, and the split's
# threads only queue behind each other. Four step-heavy test files (matrix, packed, context, 1f1b) took 145-152 s
# with it against 163-166 s without, and `dev.py test` 13:08-14:18 against 17:45 (pytest 782-852 s against 989 s),
# on 2026-12-02. It decides how LLVM's work is split, not what the program computes. Subprocesses the tests
# launch inherit the flags. Users, and benchmarks run by hand, keep XLA's defaults; TORCHSHARD_TEST_XLA_DEFAULTS=1
# runs the tests with them too.
FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_parallel_codegen_split_count=1",
)
# XLA on CPU aborts the whole process when a collective's devices reach it too far apart ("Termination timeout
# for `all to all` ... rendezvous", after 40 s). The deadlock behind most such aborts (devices starting two
# collectives in different orders, each holding one of too few pool threads) is gone: `use_cpu_devices` below
# sizes XLA's CPU pool, as it does for users. What is left is lag: on 2 cores loaded by the suite and other work,
# one device's thread can fall that far behind the others. The tests wait for it instead (pytest-timeout still
# ends a test that truly hangs). Not a compiler flag: it holds with XLA's defaults too.
PATIENT_COLLECTIVES = ("--xla_cpu_collective_call_terminate_timeout_seconds=600",)
CHOSEN = "_TORCHSHARD_TEST_XLA_FLAGS"  # what the first pytest process picked; its workers reuse it


def _with(flags: str) -> str:
    """XLA_FLAGS plus ``flags``, each once (pytest's workers inherit what their parent added)."""
    return " ".join(dict.fromkeys([*os.environ.get("XLA_FLAGS", "").split(), *flags.split()]))


def _starts_with(flags: list[str]) -> bool:
    env = {**os.environ, "XLA_FLAGS": _with(" ".join(flags))}
    probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


def _known(flags: tuple[str, ...]) -> str:
    """The ``flags`` this jaxlib knows: XLA aborts the process on an unknown one (0.11.2 dropped the
    fusion-emitter flag), so each is tried in a throwaway process first."""
    if _starts_with(list(flags)):
        return " ".join(flags)
    return " ".join(flag for flag in flags if _starts_with([flag]))


if CHOSEN not in os.environ:
    defaults = bool(os.environ.get("TORCHSHARD_TEST_XLA_DEFAULTS"))
    os.environ[CHOSEN] = _known(PATIENT_COLLECTIVES + (() if defaults else FAST_COMPILE))
    if defaults:  # a process a fast-flagged one started (the conformance matrix's XLA_DEFAULTS families)
        fast = {flag.split("=")[0] for flag in FAST_COMPILE}
        kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag.split("=")[0] not in fast]
        os.environ["XLA_FLAGS"] = " ".join(kept)
os.environ["XLA_FLAGS"] = _with(os.environ[CHOSEN])

# Eager torch, the truth of every test, runs tiny ops: its OpenMP threads only spin waiting for each other while
# XLA's threads and the other pytest worker hold the 2 cores (a tiny MLP's AdamW step took 20-80 ms with 2 threads
# on a loaded machine, 1-2 ms with 1). One thread each, for the tests and the processes they launch; ops this small
# run on one thread anyway, so the values are the same.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import torchshard  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
torchshard.use_cpu_devices(8)  # and 4 XLA pool threads per device, for collectives (its docstring says why)


# Docstring examples over ~1.5 s, which `dev.py quick` leaves out like the tests marked slow (an example cannot carry
# a marker), each with the reason it is slow.
SLOW_EXAMPLES = {
    "torchshard._search.search.search": "the search compiles in a child process it starts: ~11 s",
    "torchshard._trainer.staged_init.init_sharded": "compiles a staged init and a Trainer's step: ~1.5-2 s",
}


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker (-m "not slow")
def pytest_collection_modifyitems(config, items):
    """Marks the `SLOW_EXAMPLES` slow."""
    for item in items:
        if isinstance(item, pytest.DoctestItem) and item.name in SLOW_EXAMPLES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _doctest_names(doctest_namespace):
    """Docstring examples may use ``torch``, ``jax``, ``np``, ``P`` and ``ts`` without importing them."""
    import jax
    import numpy as np
    import torch
    from jax.sharding import PartitionSpec

    doctest_namespace.update(torch=torch, jax=jax, np=np, P=PartitionSpec, ts=torchshard)


@pytest.fixture(autouse=True)
def _no_traced_rng_key_left_behind(request):
    """A test that leaves a tracer as torchax's RNG key fails, naming itself; the key is reset so the tests after
    it in the worker (which would fail with UnexpectedTracerError at their first random draw) are not blamed."""
    yield
    import jax

    from torchshard._bridge.env import backend_started, env

    if not backend_started():  # env() would start it
        return
    tx = env()
    if isinstance(tx.param.prng, jax.core.Tracer):
        tx.param.prng = jax.random.key(0)
        pytest.fail(f"{request.node.nodeid} left a tracer as torchax's RNG key: a random draw was traced outside "
                    "a seeded block")  # fmt: skip
