"""Smoke tests: the examples run and check themselves against eager torch.

Each runs its ``main(argv)`` in this process (what ``python examples/NAME.py ARGS`` calls), not in a subprocess: a
fresh process would spend most of its time importing torch and JAX again. Running in a fresh process, where
``use_cpu_devices`` must come before JAX starts, is tested in tests/test_mesh.py.
"""

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(script: str):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mlp_forward_runs_matches_torch_and_exits_non_zero_on_a_mismatch(capsys):
    module = _example("mlp_forward.py")
    assert module.main(["--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "layers.0.weight  1024×784" in out and "P('model', None)" in out and "512×784" in out
    assert "Mesh(data=4, model=2): 8 tensors" in out
    assert "CPU 0,2,4,6" in out  # the weight's device grid
    assert "output (16, 10)" in out
    assert "sharded vs eager torch" in out and out.rstrip().endswith("ok")
    assert module.main(["--batch", "16", "--tol", "-1"]) == 1  # no error is below a negative tolerance
    assert capsys.readouterr().out.rstrip().endswith("MISMATCH")


@pytest.mark.slow
def test_train_mlp_runs_checkpoints_resumes_and_matches_torch(tmp_path, capsys):
    module = _example("train_mlp.py")
    args = ["--batch", "64", "--plans", "dp,tp,fsdp", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    assert module.main(["--steps", "2", *args]) == 0
    first = capsys.readouterr().out
    assert "tp vs eager torch" in first and "FAIL" not in first
    assert module.main(["--steps", "4", "--resume", *args]) == 0
    resumed = capsys.readouterr().out
    assert "fsdp: resumed at step 2" in resumed
    assert resumed.count("(rtol 0.0001: ok)") == 3
