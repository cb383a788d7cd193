"""Smoke tests: the tensor-parallel examples run end to end, small, in a fresh process with 8 CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HF_SMALL = ["--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--intermediate", "128"]
HF_SMALL += ["--vocab", "128", "--seq", "16", "--batch", "8"]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(ROOT / "examples" / f"{name}.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_transformer_tp_matches_eager_torch():
    small = ["--dim", "32", "--heads", "4", "--layers", "1", "--batch", "8", "--seq", "8", "--steps", "2"]
    result = run_example("transformer_tp", *small)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "losses match eager torch" in result.stdout
    assert "data=2,model=4" in result.stdout and "data=4,model=2" in result.stdout


@pytest.mark.slow
def test_hf_llama_trains():
    pytest.importorskip("transformers")
    result = run_example("hf_llama", *HF_SMALL, "--steps", "3", "--tie")  # tests/test_hf.py checks untied too
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model.layers.0.self_attn.q_proj.weight" in result.stdout  # the plan table
    assert "all-reduce" in result.stdout  # the collectives table
    assert "over 3 steps" in result.stdout
    assert "train" in result.stderr  # the progress bar


@pytest.mark.slow
def test_hf_llama_rejects_heads_the_model_axis_splits():
    pytest.importorskip("transformers")
    result = run_example("hf_llama", *HF_SMALL, "--mesh", "data=2,model=4", "--steps", "1")
    assert result.returncode != 0
    assert "ShardingError" in result.stderr
    assert "config.num_key_value_heads=2 is not divisible by the 'model' axis size 4" in result.stderr
