"""Shared test helpers: the one comparison against eager torch, benchmark runs, fresh processes."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]  # the clone: `testsupport` and `tools` import from it
# why a test that runs tokamax skips on a lane without it (the pinned one)
TOKAMAX_NEEDS = "tokamax needs Python >= 3.12 and jax >= 0.11.1 (docs/kernels.md)"


def to_numpy(t) -> np.ndarray:
    """Any torch / torchax / jax value as a float64 numpy array."""
    if hasattr(t, "jax"):
        t = t.jax()
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().numpy()
    return np.asarray(t, dtype=np.float64)


def scaled_error(actual, expected) -> float:
    """max|actual - expected| / max(1, max|expected|): the error `assert_close` bounds (shapes must agree)."""
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    return float(np.abs(a - e).max(initial=0.0)) / max(1.0, float(np.abs(e).max(initial=0.0)))


def assert_close(actual, expected, *, tol: float = 1e-5, what: str = "") -> None:
    """|actual - expected| ≤ tol × max(1, max|expected|): absolute tolerance relative to the output scale."""
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    error = scaled_error(a, e)
    assert error <= tol, f"{what}: max abs error / max(1, max|expected|) = {error:.3g} > {tol}"


def assert_trees_close(actual: dict, expected: dict, *, tol: float = 1e-5) -> None:
    """Same keys, each value within `assert_close`."""
    assert set(actual) == set(expected), set(actual) ^ set(expected)
    for name in expected:
        assert_close(actual[name], expected[name], tol=tol, what=name)


def torch_losses(model, loss_fn, opt, batches) -> list[float]:
    """The truth: eager, unsharded torch training, one optimizer step per batch; returns the losses."""
    out = []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(model, b)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def eager_value_and_grads(fn, inputs, argnums):
    """The truth for an op: ``fn(*inputs)`` in eager torch, and its gradients with respect to ``argnums``."""
    leaves = [t.clone().requires_grad_(i in argnums) for i, t in enumerate(inputs)]
    value = fn(*leaves)
    value.backward()
    return value.detach(), [leaves[i].grad for i in argnums]


def on_jax(inputs):
    """CPU torch tensors as torchax tensors (unsharded jax arrays)."""
    import jax.numpy as jnp

    from torchshard._bridge.tensors import wrap

    return [wrap(jnp.asarray(t.numpy())) for t in inputs]


def module_tensors(model) -> dict:
    """Every parameter and buffer of ``model`` under every name (tied names included)."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def jit_forward(model, *, output: str | None = None, **kwargs):
    """``model``'s forward as one jitted function of its own (placed) tensors and the input (+ ``kwargs``);
    ``output`` names the attribute of the model's output to return (``"logits"`` of a transformers output)."""
    import torchax.interop

    def call(p, x):
        out = torch.func.functional_call(model, p, (x,), kwargs)
        return getattr(out, output) if output else out

    params = dict(model.named_parameters()) | dict(model.named_buffers())  # one entry per tied tensor
    forward = torchax.interop.jax_jit(call)
    return lambda x: forward(params, x)


class Counter(torch.nn.Module):
    """A module with an int64 buffer whose value needs 64 bits (a token count, say)."""

    def __init__(self, count: int = 2**40):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.tensor([count, 1]))


def assert_attention_matches(attend, torch_fn, mesh, q, k, v, w) -> None:
    """``sum(attend(q, k, v) * w)`` and its q/k/v gradients, jitted on ``mesh`` (batch over "data", the sequence
    over "context"), against ``torch_fn(q, k, v)`` in eager torch: the one check of the attention kernels."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    expected, expected_grads = eager_value_and_grads(torch_fn, [q, k, v], argnums=(0, 1, 2))
    place = functools.partial(jax.device_put, device=NamedSharding(mesh, PartitionSpec("data", None, "context")))
    q_, k_, v_, w_ = (place(jnp.asarray(t.numpy())) for t in (q, k, v, w))
    loss = lambda q, k, v: (attend(q, k, v) * w_).sum()  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q_, k_, v_)
    assert_close(value, expected, what="value")
    for name, got, want in zip("qkv", grads, expected_grads, strict=True):
        assert_close(got, want, what=f"d{name}")


# One fresh Python process checks what needs a process that has not started JAX (import side effects,
# use_cpu_devices before the backend starts, eager optimizers after import), instead of one process per test:
# each start spends seconds importing torch and JAX. Its stdout and stderr are split at a marker line after
# `import torchshard`, so a later step's output cannot be mistaken for the import's.
FRESH_PROCESS = """
import json, sys
import torchshard
from jax._src import xla_bridge
started = sorted(xla_bridge._backends)
print("-- imported --", flush=True)
print("-- imported --", file=sys.stderr, flush=True)
import jax, torch
w = torch.nn.Parameter(torch.ones(3))  # eager optimizers straight after the import, before JAX starts
for opt in (torch.optim.Adam([w]), torch.optim.SGD([w], lr=0.1), torch.optim.AdamW([w])):
    w.sum().backward(); opt.step(); opt.zero_grad()
torchshard.use_cpu_devices(3)
devices = [jax.device_count(), jax.devices()[0].platform]
print(json.dumps({"backends_after_import": started, "devices": devices, "optimizers_stepped": True}))
"""


@functools.cache
def fresh_process() -> dict:
    """What FRESH_PROCESS found (run once per pytest process): its report, and what it printed on import."""
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    out, _, rest = done.stdout.partition("-- imported --\n")
    err, _, later_err = done.stderr.partition("-- imported --\n")
    report = json.loads(rest.splitlines()[-1]) if done.returncode == 0 else {}
    return {**report, "returncode": done.returncode, "import_stdout": out, "import_stderr": err,
            "stderr": later_err or err}  # fmt: skip


BENCHMARKS = ROOT / "benchmarks"


def run_benchmark(name: str, *args: str) -> str:
    """What ``python benchmarks/NAME ARGS`` prints, run in this process; fails on a non-zero exit (a benchmark's
    own checks failing included).

    A benchmark smoke run in a fresh process spent ~6 CPU seconds importing torch, JAX and transformers before its
    first line; here they are loaded already. The script runs as ``__main__`` with its own folder first on
    ``sys.path`` (as ``python PATH`` has it), Python's default warning filters (not the suite's ``error``), and this
    process's 8 CPU devices (every benchmark that runs here asks for 8: `ts.use_cpu_devices` repeats are no-ops).
    Processes it starts itself (torch baselines, launched ranks) are still fresh ones.
    """
    import contextlib
    import io
    import runpy
    import warnings
    from unittest import mock

    path = BENCHMARKS / name
    out = io.StringIO()
    argv, sys_path = [str(path), *args], [str(path.parent), *sys.path]
    with mock.patch.object(sys, "argv", argv), mock.patch.object(sys, "path", sys_path), warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")
        torch_state = torch.random.get_rng_state()
        try:
            with contextlib.redirect_stdout(out):
                runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exit:
            assert exit.code in (None, 0), f"{path.name} exited with {exit.code!r}:\n{out.getvalue()[-4000:]}"
        finally:
            torch.random.set_rng_state(torch_state)  # scripts seed torch's global generator; later tests must not
    return out.getvalue()


def root_env(**extra: str) -> dict[str, str]:
    """This process's environment, and ``extra``, with the clone first on ``PYTHONPATH``: a script a test launches
    by path (``python tests/x.py``, torchrun, the launcher) imports `testsupport` and `tools` from it, as every
    command of ``python3 dev.py`` does."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **extra, "PYTHONPATH": path}
