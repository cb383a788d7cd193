"""python -m torchshard plan: valid and invalid plans, exit codes, formats, and a 7B model planned on meta."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optax
import pytest
import torch
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import torchshard as ts
from testsupport.models import MLP, tiny_llama
from torchshard import presets
from torchshard.__main__ import EXIT_DOES_NOT_FIT, EXIT_INVALID_PLAN, EXIT_OK, EXIT_USAGE, main
from torchshard.presets import hf_rules

MLP_ARG, TIED_ARG = "testsupport.models:MLP", "testsupport.models:TiedLM"  # MODULE:FACTORY, as users name them


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
    code, out, err = _run(capsys, MLP_ARG, "--mesh", "data=4,model=2", "--preset", "fsdp")
    assert code == EXIT_OK, err
    assert out.startswith("MLP on Mesh(data=4, model=2) (local devices)")
    assert "layers.0.weight" in out and "training memory per device (AdamW, activations not included):" in out
    assert "largest replicated tensors" in out


def test_json_totals_match_the_plan(capsys):
    code, out, _ = _run(capsys, TIED_ARG, "--mesh", "data=8,model=8", "--preset", "fsdp", "--format", "json")
    data = json.loads(out)
    assert code == EXIT_OK and data["abstract_mesh"] is True and data["mesh"] == {"data": 8, "model": 8}
    mesh = AbstractMesh((8, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    from testsupport.models import TiedLM

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
    code, out, _ = _run(capsys, MLP_ARG, "--mesh", "data=4,model=2", "--rules", rules, "--format", "markdown")
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
    code, out, _ = _run(capsys, TIED_ARG, "--mesh", "data=4,model=2", "--preset", "fsdp", "--format", "compact")
    assert code == EXIT_OK
    assert "Mesh(data=4, model=2): 10 of 10 tensors shown" in out
    assert "embed.weight = head.weight  64×32" in out and "training memory per device" in out


def test_compare_lists_the_specs_that_differ(capsys, tmp_path):
    rules = _file(tmp_path, "rules.py", 'RULES = [(r"layers\\.0\\.weight", ("model", None))]\n')
    argv = [MLP_ARG, "--mesh", "data=4,model=2", "--rules", rules, "--compare", "fsdp"]
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
    code, out, err = _run(capsys, MLP_ARG, "--mesh", mesh, "--rules", _file(tmp_path, "r.py", rules))
    assert code == EXIT_INVALID_PLAN and out == ""
    assert err.startswith("error: invalid sharding plan")
    for message in messages:
        assert re.search(message, err), err


def test_preset_axis_missing_from_mesh(capsys):
    code, _, err = _run(capsys, MLP_ARG, "--mesh", "rows=8", "--preset", "fsdp")
    assert code == EXIT_INVALID_PLAN
    assert "--preset fsdp shards over ['data'], which mesh {'rows': 8} lacks" in err


USAGE = {
    "bad mesh": ([MLP_ARG, "--mesh", "data:8"], r"--mesh 'data:8': write axis=size pairs"),
    "no colon": (["testsupport.models", "--mesh", "data=8"], r"'testsupport.models': write MODULE:FACTORY"),
    "no module": (["no_such_module_xyz:f", "--mesh", "data=8"], r"cannot import 'no_such_module_xyz'"),
    "no attribute": (["testsupport.models:Nope", "--mesh", "data=8"], r"'testsupport.models' has no attribute 'Nope'"),
    "not a module": (["os:getcwd", "--mesh", "data=8"], r"the factory returned a str, not a torch.nn.Module"),
    "bad compare": ([MLP_ARG, "--mesh", "data=8", "--compare", "zero"], r"--compare 'zero': give a preset"),
    "hf on a plain model": ([MLP_ARG, "--mesh", "data=4,model=2", "--preset", "hf"],
                            r"--preset hf: MLP is not a transformers model \(no \.config\); use fsdp\+tp"),
    "compile options alone": ([MLP_ARG, "--mesh", "data=8", "--batch", "8x4", "--scan"],
                              r"--batch, --scan given without --compile"),
    "compile without batch": ([MLP_ARG, "--mesh", "data=8", "--compile"], r"--compile needs --batch, e.g."),
    "bad batch": ([MLP_ARG, "--mesh", "data=8", "--compile", "--batch", "8xfoo"],
                  r"--batch '8xfoo': write each leaf as sizes joined by x"),
    "bad batch dtype": ([MLP_ARG, "--mesh", "data=8", "--compile", "--batch", "8x32:floaty"],
                        r"'floaty' is not a torch dtype"),
    "bad device memory": ([MLP_ARG, "--mesh", "data=8", "--compile", "--batch", "8x32", "--device-memory", "8 pb"],
                          r"--device-memory '8 pb': write a size such as 80GiB"),
    "no device memory": ([MLP_ARG, "--mesh", "data=8", "--compile", "--batch", "8x32", "--device-memory", "0"],
                         r"--device-memory '0' is 0 bytes; give a device's memory, e.g. 80GiB"),
    "no default loss": ([MLP_ARG, "--mesh", "data=8", "--compile", "--batch", "8x32:float32"],
                        r"MLP\.forward takes no input_ids and labels, so there is no default loss; pass --loss"),
    "more devices than started": ([MLP_ARG, "--mesh", "data=16", "--compile", "--batch", "16x32:float32"],
                                  r"needs 16 CPU devices, but JAX already started with 8 in this process"),
    "free axis with compile": ([MLP_ARG, "--mesh", "data=-1", "--compile", "--batch", "16x32"],
                               r"--compile: give every mesh axis a positive size"),
    "pipeline without compile": ([MLP_ARG, "--mesh", "stage=2,data=4", "--pipeline", "stage=2"],
                                 r"--pipeline given without --compile"),
    "pipeline axis not in mesh": ([MLP_ARG, "--mesh", "data=8", "--compile", "--batch", "8x32",
                                   "--pipeline", "stage=2,microbatches=2"],
                                  r"--pipeline stage=2: --mesh data=8 gives no axis stage of size 2; add stage=2"),
    "pipeline without axis": ([MLP_ARG, "--mesh", "stage=2,data=4", "--compile", "--batch", "8x32",
                               "--pipeline", "microbatches=2"], r"name the stage axis and its size once"),
    "pipeline bad value": ([MLP_ARG, "--mesh", "stage=2,data=4", "--compile", "--batch", "8x32",
                            "--pipeline", "stage=2,microbatches=two"], r"microbatches=.two. must be a positive"),
    "pipeline bad schedule": ([MLP_ARG, "--mesh", "stage=2,data=4", "--compile", "--batch", "8x32",
                               "--pipeline", "stage=2,schedule=zb"], r"schedule='zb' must be one of"),
}  # fmt: skip


@pytest.mark.parametrize("case", USAGE)
def test_usage_errors_exit_2(case, capsys):
    argv, message = USAGE[case]
    code, _, err = _run(capsys, *argv)
    assert code == EXIT_USAGE
    assert re.search(message, err), err


def test_rules_file_without_rules(capsys, tmp_path):
    code, _, err = _run(capsys, MLP_ARG, "--mesh", "data=8", "--rules", _file(tmp_path, "r.py", "X = 1\n"))
    assert code == EXIT_USAGE and "defines no RULES" in err


LLAMA_7B = """
from transformers import LlamaConfig, LlamaForCausalLM

def build():
    config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, vocab_size=32000,
                         num_attention_heads=32, num_key_value_heads=32)
    return LlamaForCausalLM(config)
"""

# the process's own peak (VmHWM): getrusage's ru_maxrss keeps, across exec, the high-water mark of the memory
# the child was forked (or vforked) from, so a pytest worker of 3 GiB made a 0.5 GiB plan read as 3.1 GiB
_MEASURED = (
    "import re, sys\n"
    "from torchshard.__main__ import main\n"
    "code = main(sys.argv[1:])\n"
    "peak = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
    "print(f'maxrss_kib={peak}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def _cli(tmp_path, *argv):
    start = time.perf_counter()
    # the torchshard under test, also when it is not the installed one (a git worktree)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(ts.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", _MEASURED, "plan", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    return done, time.perf_counter() - start


@pytest.mark.slow
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


@pytest.mark.slow
def test_invalid_plan_exit_code_in_a_real_process(tmp_path):
    _file(tmp_path, "tiny.py", "from torch import nn\n\ndef build():\n    return nn.Linear(8, 8)\n")
    rules = _file(tmp_path, "rules.py", 'RULES = [(r".*", ("model",))]\n')
    done, _ = _cli(tmp_path, "tiny:build", "--mesh", "data=8", "--rules", rules)
    assert done.returncode == EXIT_INVALID_PLAN
    assert "unknown mesh axis 'model'" in done.stderr


TINY_LM = """
import transformers

def build():
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=128, use_cache=False)
    return transformers.LlamaForCausalLM(config)
"""
MLP_FILES = {
    "mlp.py": "from torch import nn\n\n"
    "def build():\n    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))\n",
    "mse.py": "from torch.nn import functional as F\n\n"
    "def loss(model, batch):\n    return F.mse_loss(model(batch[0]), batch[1])\n",
}
MLP_COMPILE = ["mlp.py:build", "--preset", "fsdp", "--compile", "--batch", "32x32:float32,32x16:float32",
               "--loss", "mse.py:loss", "--optimizer", "adam"]  # fmt: skip
COMPILED_KEYS = {"argument_bytes", "temp_bytes", "output_bytes", "alias_bytes", "peak_bytes"}


def test_preset_hf_is_hf_rules(capsys, tmp_path):
    lm = _file(tmp_path, "tiny_lm.py", TINY_LM)
    code, out, err = _run(capsys, f"{lm}:build", "--mesh", "data=4,model=2", "--preset", "hf", "--format", "json")
    model = tiny_llama(meta=True)
    assert code == EXIT_OK, err
    assert json.loads(out)["tensors"] == ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), hf_rules(model)).rows()


def test_help_describes_every_preset(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for name in ("fsdp", "tp", "fsdp+tp", "hf"):
        assert re.search(rf"^  {re.escape(name)} +\S", out, re.MULTILINE), name
    assert "presets.hf_rules(model, axis=TP_AXIS, fsdp_axis=FSDP_AXIS)" in " ".join(out.split())


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.slow
def test_compiled_figures_are_the_real_trainers(capsys, tmp_path):
    lm = _file(tmp_path, "tiny_lm.py", TINY_LM)
    argv = ["--mesh", "data=4,model=2", "--preset", "hf", "--compile", "--batch", "8x16", "--scan", "--remat",
            r"model\.layers\.\d+", "--precision", "bf16", "--format", "json"]  # fmt: skip
    code, out, err = _run(capsys, f"{lm}:build", *argv)
    assert code == EXIT_OK, err
    data = json.loads(out)
    model = tiny_llama()
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), hf_rules(model))
    trainer = ts.Trainer(model, lm_loss, optax.adamw(1e-4), plan, scan_layers=True, remat=r"model\.layers\.\d+",
                         precision=ts.MixedPrecision())  # fmt: skip
    batch = torch.randint(0, 128, (8, 16))
    assert data["compiled"] == dataclasses.asdict(ts.inspect.memory(trainer, batch))
    stats = trainer.lower(batch).compile().memory_analysis()
    assert (data["compiled"]["argument_bytes"], data["compiled"]["temp_bytes"], data["compiled"]["output_bytes"],
            data["compiled"]["alias_bytes"]) == (stats.argument_size_in_bytes, stats.temp_size_in_bytes,
                                                 stats.output_size_in_bytes, stats.alias_size_in_bytes)  # fmt: skip
    assert math.isfinite(float(trainer.step(batch)["loss"]))  # the program measured is one that runs
    assert data["compile"]["plan_argument_bytes"] == pytest.approx(data["compiled"]["argument_bytes"], rel=0.01)
    mem = data["per_device_bytes"]
    assert mem["params"] == plan.bytes_per_device("param")  # fp32 already: MixedPrecision stores fp32
    assert data["simulated_devices"] == 8 and "device_memory" not in data


@pytest.mark.slow
def test_pipelined_figures_are_the_real_trainers(capsys, tmp_path):
    lm = _file(tmp_path, "tiny_lm.py", TINY_LM)
    argv = ["--mesh", "stage=2,data=4", "--preset", "fsdp", "--compile", "--batch", "8x16",
            "--pipeline", "stage=2,microbatches=2,schedule=1f1b"]  # fmt: skip
    code, out, err = _run(capsys, f"{lm}:build", *argv, "--format", "json")
    assert code == EXIT_OK, err
    data = json.loads(out)
    model = tiny_llama()
    plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 4}), presets.fsdp("data"))
    trainer = ts.Trainer(model, lm_loss, optax.adamw(1e-4), plan,
                         pipeline=ts.Pipeline(microbatches=2, schedule="1f1b"))  # fmt: skip
    batch = torch.randint(0, 128, (8, 16))
    assert data["compiled"] == dataclasses.asdict(ts.inspect.memory(trainer, batch))
    assert math.isfinite(float(trainer.step(batch)["loss"]))
    assert data["compile"]["pipeline"] == {"axis": "stage", "microbatches": 2, "schedule": "1f1b", "repeats": 1,
                                           "layers": None, "stages": 2, "bubble": 1 / 3}  # fmt: skip
    assert data["compile"]["plan_argument_bytes"] == pytest.approx(data["compiled"]["argument_bytes"], rel=0.01)
    assert data["per_device_bytes"]["params"] == trainer.plan.bytes_per_device("param")  # one stage's layers
    assert data["per_device_bytes"]["params"] < plan.bytes_per_device("param")
    assert data["tensors"] == trainer.plan.rows()  # with the stage column
    traffic = ts.inspect.collectives(trainer, batch).per_axes  # bytes per step, loop trip counts applied
    assert data["compile"]["collective_bytes_per_step"] == dict(sorted(traffic.items()))
    assert traffic["data"] > 0 and traffic["stage"] > 0
    code, out, err = _run(capsys, f"{lm}:build", *argv)
    assert "pipeline 1f1b over stage=2 × 2 micro-batches (bubble 0.333)" in out
    assert re.search(r"collectives per step \(.*loop trip counts applied\): .*data [\d.]+ \w?i?B", out)


def test_device_memory_too_small_exits_3(capsys, tmp_path, monkeypatch):
    for name, text in MLP_FILES.items():
        _file(tmp_path, name, text)
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, *MLP_COMPILE, "--mesh", "data=8", "--device-memory", "1KiB", "--format", "json")
    assert code == EXIT_DOES_NOT_FIT, err
    data = json.loads(out)
    compiled = data["compiled"]
    assert set(compiled) == COMPILED_KEYS
    peak = compiled["argument_bytes"] + compiled["output_bytes"] - compiled["alias_bytes"] + compiled["temp_bytes"]
    assert compiled["peak_bytes"] == peak > 1024
    assert data["device_memory"] == {"bytes": 1024, "fits": False, "margin_bytes": 1024 - peak}
    code, out, err = _run(capsys, *MLP_COMPILE, "--mesh", "data=8", "--device-memory", "1GiB")
    assert code == EXIT_OK, err
    assert "peak = arguments + outputs - aliased + temporaries" in out
    assert re.search(r"^fits in 1\.00 GiB per device: peak .*, margin .* \(\d+\.\d%\)$", out, re.MULTILINE)
    assert "compiling it for 8 simulated devices" in err


@pytest.mark.slow
def test_compile_in_a_fresh_process_simulates_the_devices(tmp_path):
    for name, text in MLP_FILES.items():
        _file(tmp_path, name, text)
    done, _ = _cli(tmp_path, *MLP_COMPILE, "--mesh", "data=16", "--device-memory", "100B")
    assert done.returncode == EXIT_DOES_NOT_FIT, done.stderr
    assert done.stdout.startswith("Sequential on Mesh(data=16) (16 simulated CPU devices)")
    assert "compiled training step per device (XLA:CPU on 16 simulated devices" in done.stdout
    assert re.search(r"^does not fit in 100 B per device: peak .* is .* over$", done.stdout, re.MULTILINE)


def test_remat_policy_takes_every_policy_remat_takes():
    """``plan --compile --remat-policy matmuls`` was refused, though ``Remat(policy="matmuls")`` is the GPU policy."""
    from torchshard.__main__ import build_parser
    from torchshard._train.remat import POLICY_NAMES

    for policy in POLICY_NAMES:
        args = build_parser().parse_args(["plan", MLP_ARG, "--mesh", "data=8", "--compile", "--remat-policy", policy])
        assert args.remat_policy == policy
