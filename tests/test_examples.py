"""Smoke tests: the examples run as scripts and check themselves against eager torch."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLES.parent,
    )


@pytest.mark.slow
def test_mlp_forward_runs_and_matches_torch():
    done = _run("mlp_forward.py", "--batch", "16")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "layers.0.weight  1024×784" in out and "P('model', None)" in out and "512×784" in out
    assert "Mesh(data=4, model=2): 8 tensors" in out
    assert "CPU 0,2,4,6" in out  # the weight's device grid
    assert "output (16, 10)" in out
    assert "sharded vs eager torch" in out and out.rstrip().endswith("ok")


def test_mlp_forward_exits_non_zero_on_a_mismatch():
    spec = importlib.util.spec_from_file_location("mlp_forward", EXAMPLES / "mlp_forward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--batch", "8", "--tol", "-1"]) == 1  # no error is below a negative tolerance


@pytest.mark.slow
def test_train_mlp_runs_checkpoints_resumes_and_matches_torch(tmp_path):
    args = ["--batch", "64", "--plans", "dp,tp,fsdp", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    first = _run("train_mlp.py", "--steps", "2", *args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "tp vs eager torch" in first.stdout and "FAIL" not in first.stdout
    resumed = _run("train_mlp.py", "--steps", "4", "--resume", *args)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "fsdp: resumed at step 2" in resumed.stdout
    assert resumed.stdout.count("(rtol 0.0001: ok)") == 3
