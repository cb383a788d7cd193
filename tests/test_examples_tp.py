"""Smoke tests: the tensor-parallel examples run end to end, small, with 8 CPU devices.

Each runs its ``main(argv)`` in this process (what ``python examples/NAME.py ARGS`` calls), not in a subprocess,
whose time was mostly importing torch, transformers and JAX again (see tests/test_examples.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from torchshard import ShardingError

ROOT = Path(__file__).resolve().parents[1]
HF_SMALL = ["--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--intermediate", "128"]
HF_SMALL += ["--vocab", "128", "--seq", "16", "--batch", "8"]


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_transformer_tp_matches_eager_torch(capsys):
    small = ["--dim", "32", "--heads", "4", "--layers", "1", "--batch", "8", "--seq", "8", "--steps", "2"]
    assert example("transformer_tp").main(small) == 0
    out = capsys.readouterr().out
    assert "losses match eager torch" in out
    assert "data=2,model=4" in out and "data=4,model=2" in out


@pytest.mark.slow
def test_hf_llama_trains(capsys):
    pytest.importorskip("transformers")
    assert example("hf_llama").main([*HF_SMALL, "--steps", "3", "--tie"]) == 0  # tests/test_hf.py checks untied too
    out, err = capsys.readouterr()
    assert "model.layers.0.self_attn.q_proj.weight" in out  # the plan table
    assert "all-reduce" in out  # the collectives table
    assert "over 3 steps" in out
    assert "train" in err  # the progress bar


def test_hf_llama_rejects_heads_the_model_axis_splits():
    pytest.importorskip("transformers")
    match = r"config.num_key_value_heads=2 is not divisible by the 'model' axis size 4"
    with pytest.raises(ShardingError, match=match):
        example("hf_llama").main([*HF_SMALL, "--mesh", "data=2,model=4", "--steps", "1"])
