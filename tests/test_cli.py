"""python -m torchshard plan: valid and invalid plans, exit codes, formats, and a 7B model planned on meta."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import textwrap
import time

import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from models import MLP

import torchshard as ts
from torchshard import presets
from torchshard.__main__ import EXIT_INVALID_PLAN, EXIT_OK, EXIT_USAGE, main


def _run(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_plan_works_on_an_abstract_mesh_larger_than_the_devices():
    mesh = AbstractMesh((8, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    p = ts.plan(MLP(), mesh, presets.fsdp("data", min_size=16) + ts.Rules([(r"layers\.0\.weight", ("model",))]))
    assert p.spec("layers.0.weight") == P("model", "data")
    assert p.entries["layers.0.weight"].shard_shape == (8, 4)
    assert p.mesh is mesh and "Mesh(data=8, model=8)" in p.table()


def test_table(capsys):
    code, out, err = _run(capsys, "models:MLP", "--mesh", "data=4,model=2", "--preset", "fsdp")
    assert code == EXIT_OK, err
    assert out.startswith("MLP on Mesh(data=4, model=2) (local devices)")
    assert "layers.0.weight" in out and "training memory per device (AdamW, activations not included):" in out
    assert "largest replicated tensors" in out


def test_json_totals_match_the_plan(capsys):
    code, out, _ = _run(capsys, "models:TiedLM", "--mesh", "data=8,model=8", "--preset", "fsdp", "--format", "json")
    data = json.loads(out)
    assert code == EXIT_OK and data["abstract_mesh"] is True and data["mesh"] == {"data": 8, "model": 8}
    mesh = AbstractMesh((8, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    from models import TiedLM

    expected = ts.plan(TiedLM(), mesh, presets.fsdp("data"))
    assert data["tensors"] == expected.rows()
    mem = data["per_device_bytes"]
    assert mem["params"] == mem["grads"] == expected.bytes_per_device("param")
    assert mem["AdamW state (2 copies)"] == 2 * mem["grads"] and mem["buffers"] == expected.bytes_per_device("buffer")
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    top = data["largest_replicated"]
    assert top[0]["bytes_per_device"] == max(r["bytes_per_device"] for r in top)
    assert all("model" in r["replicated_over"] for r in top)


def test_markdown_and_rules_file(capsys, tmp_path):
    rules = _file(tmp_path, "rules.py", 'RULES = [(r"layers\\.0\\.weight", ("model", "data"))]\n')
    code, out, _ = _run(capsys, "models:MLP", "--mesh", "data=4,model=2", "--rules", rules, "--format", "markdown")
    assert code == EXIT_OK
    assert out.startswith("**MLP on Mesh(data=4, model=2)")
    assert "| `layers.0.weight` | 64×32 | float32 | `P('model', 'data')` | 32×8 | 1.00 KiB |" in out


def test_tp_preset_uses_common_projection_names(capsys, tmp_path):
    factory = _file(
        tmp_path,
        "mlp_block.py",
        """
        from torch import nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.up_proj, self.down_proj = nn.Linear(16, 64), nn.Linear(64, 16)

        def build():
            return nn.ModuleDict({"block": Block()})
        """,
    )
    code, out, err = _run(
        capsys, f"{factory}:build", "--mesh", "data=2,model=4", "--preset", "fsdp+tp", "--format", "json"
    )
    specs = {r["name"]: r["spec"] for r in json.loads(out)["tensors"]}
    assert code == EXIT_OK, err
    assert specs["block.up_proj.weight"] == str(P("model", None))
    assert specs["block.up_proj.bias"] == str(P("model"))
    assert specs["block.down_proj.weight"] == str(P(None, "model"))


def test_compact_format_shows_each_tensor_once(capsys):
    code, out, _ = _run(capsys, "models:TiedLM", "--mesh", "data=4,model=2", "--preset", "fsdp", "--format", "compact")
    assert code == EXIT_OK
    assert "Mesh(data=4, model=2): 10 of 10 tensors shown" in out
    assert "embed.weight = head.weight  64×32" in out and "training memory per device" in out


def test_compare_lists_the_specs_that_differ(capsys, tmp_path):
    rules = _file(tmp_path, "rules.py", 'RULES = [(r"layers\\.0\\.weight", ("model", None))]\n')
    argv = ["models:MLP", "--mesh", "data=4,model=2", "--rules", rules, "--compare", "fsdp"]
    code, out, _ = _run(capsys, *argv, "--format", "json")
    mesh = ts.make_mesh({"data": 4, "model": 2})
    here, there = (
        ts.plan(MLP(), mesh, ts.Rules([(r"layers\.0\.weight", ("model", None))])),
        ts.plan(MLP(), mesh, presets.fsdp("data")),
    )
    expected = {name: [str(a), str(b)] for name, (a, b) in here.diff(there).items()}
    assert code == EXIT_OK and expected
    assert json.loads(out)["compare"] == {"against": "--preset fsdp", "differs": expected}
    code, out, _ = _run(capsys, *argv)
    assert f"compared with --preset fsdp: {len(expected)} tensor(s) differ" in out
    assert re.search(r"layers\.0\.weight\s+P\('model', None\)\s+P\(\)\n", out)  # under min_size: fsdp leaves it
    assert re.search(r"layers\.1\.weight\s+P\(\)\s+P\('data', None\)", out)


INVALID = {
    "unknown axis and indivisible dim": (
        'RULES = [(r"layers\\.0\\.weight", ("model", None)), (r"layers\\.1\\.weight", ("data", None))]',
        "data=3",
        [r"2 problems", r"unknown mesh axis 'model'", r"dim 0 \(size 64\) is not divisible by data \(size 3\)"],
    ),
    "malformed rules": ('RULES = [("layers", "data", None)]', "data=8", [r"is not a \(pattern, spec\) pair"]),
}  # fmt: skip


@pytest.mark.parametrize("case", INVALID)
def test_invalid_plan_exits_1_with_every_problem(case, capsys, tmp_path):
    rules, mesh, messages = INVALID[case]
    code, out, err = _run(capsys, "models:MLP", "--mesh", mesh, "--rules", _file(tmp_path, "r.py", rules))
    assert code == EXIT_INVALID_PLAN and out == ""
    assert err.startswith("error: invalid sharding plan")
    for message in messages:
        assert re.search(message, err), err


def test_preset_axis_missing_from_mesh(capsys):
    code, _, err = _run(capsys, "models:MLP", "--mesh", "rows=8", "--preset", "fsdp")
    assert code == EXIT_INVALID_PLAN
    assert "--preset fsdp shards over ['data'], which mesh {'rows': 8} lacks" in err


USAGE = {
    "bad mesh": (["models:MLP", "--mesh", "data:8"], r"--mesh 'data:8': write axis=size pairs"),
    "no colon": (["models", "--mesh", "data=8"], r"'models': write MODULE:FACTORY"),
    "no module": (["no_such_module_xyz:f", "--mesh", "data=8"], r"cannot import 'no_such_module_xyz'"),
    "no attribute": (["models:Nope", "--mesh", "data=8"], r"'models' has no attribute 'Nope'"),
    "not a module": (["os:getcwd", "--mesh", "data=8"], r"the factory returned a str, not a torch.nn.Module"),
    "bad compare": (["models:MLP", "--mesh", "data=8", "--compare", "zero"], r"--compare 'zero': give a preset"),
    "hf without tp plan": (["models:MLP", "--mesh", "model=8", "--preset", "hf"], r"MLP has no config.base_model"),
}  # fmt: skip


@pytest.mark.parametrize("case", USAGE)
def test_usage_errors_exit_2(case, capsys):
    argv, message = USAGE[case]
    code, _, err = _run(capsys, *argv)
    assert code == EXIT_USAGE
    assert re.search(message, err), err


def test_rules_file_without_rules(capsys, tmp_path):
    code, _, err = _run(capsys, "models:MLP", "--mesh", "data=8", "--rules", _file(tmp_path, "r.py", "X = 1\n"))
    assert code == EXIT_USAGE and "defines no RULES" in err


LLAMA_7B = """
from transformers import LlamaConfig, LlamaForCausalLM

def build():
    config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, vocab_size=32000,
                         num_attention_heads=32, num_key_value_heads=32)
    return LlamaForCausalLM(config)
"""

_MEASURED = (
    "import resource, sys\n"
    "from torchshard.__main__ import main\n"
    "code = main(sys.argv[1:])\n"
    "print(f'maxrss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def _cli(tmp_path, *argv):
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _MEASURED, "plan", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    return done, time.perf_counter() - start


def test_7b_llama_planned_on_meta_over_64_devices(tmp_path):
    _file(tmp_path, "llama7b.py", LLAMA_7B)
    done, seconds = _cli(
        tmp_path, "llama7b:build", "--mesh", "data=8,model=8", "--preset", "fsdp+tp", "--format", "json"
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    maxrss_gib = int(done.stderr.rsplit("maxrss_kib=", 1)[1]) / 2**20
    assert data["abstract_mesh"] and data["mesh"] == {"data": 8, "model": 8}
    specs = {r["name"]: r["spec"] for r in data["tensors"]}
    assert specs["model.layers.0.self_attn.q_proj.weight"] == str(P("model", "data"))
    assert specs["model.layers.31.mlp.down_proj.weight"] == str(P("data", "model"))
    unsharded = sum(math.prod(r["shape"]) * 4 for r in data["tensors"] if not r["tied_to"])
    assert unsharded > 26e9, "the model really is ~7B float32 parameters"
    assert data["per_device_bytes"]["params"] < unsharded / 40
    assert maxrss_gib < 3, f"peak RSS {maxrss_gib:.2f} GiB: parameters were materialised"
    assert seconds < 120


def test_invalid_plan_exit_code_in_a_real_process(tmp_path):
    _file(tmp_path, "tiny.py", "from torch import nn\n\ndef build():\n    return nn.Linear(8, 8)\n")
    rules = _file(tmp_path, "rules.py", 'RULES = [(r".*", ("model",))]\n')
    done, _ = _cli(tmp_path, "tiny:build", "--mesh", "data=8", "--rules", rules)
    assert done.returncode == EXIT_INVALID_PLAN
    assert "unknown mesh axis 'model'" in done.stderr
