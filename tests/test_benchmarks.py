"""Smoke runs of the benchmarks at tiny sizes, each in the test process: what their tables and JSON say."""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest

from testsupport.helpers import run_benchmark

OPS = ("all_gather", "psum", "psum_scatter", "all_to_all", "ppermute")


@pytest.mark.slow
def test_collectives_benchmark_runs(tmp_path):
    png = tmp_path / "bw.png"
    stdout = run_benchmark("collectives.py", "--sizes", "1K,4K", "--iters", "2", "--plot", str(png))
    rows = [line.split("|")[1:-1] for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header, body = [c.strip() for c in rows[0]], [[c.strip() for c in row] for row in rows[1:]]
    assert header == ["op", "devices", "size/device", "time (µs)", "algbw (GB/s)", "busbw (GB/s)"]
    assert [(r[0], r[2]) for r in body] == [(op, size) for op in OPS for size in ("1 KiB", "4 KiB")]
    for op, devices, _, micros, algbw, busbw in body:
        n = int(devices)
        factor = {"psum": 2 * (n - 1) / n, "ppermute": 1.0}.get(op, (n - 1) / n)
        assert float(micros) > 0 and float(algbw) > 0
        assert abs(float(busbw) - float(algbw) * factor) <= 2e-3 * float(algbw), (op, algbw, busbw)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _tables(stdout: str) -> list[list[list[str]]]:
    """Markdown tables of ``stdout``: rows of stripped cells, the header first."""
    tables: list[list[list[str]]] = []
    for line in stdout.splitlines():
        if not line.startswith("| "):
            continue
        if line.startswith("| config |"):
            tables.append([])
        if "---" not in line:
            tables[-1].append([c.strip() for c in line.split("|")[1:-1]])
    return tables


@pytest.mark.slow
def test_step_time_benchmark_runs():
    args = ["--batch", "64", "--steps", "2", "--warmup", "1", "--configs", "tp,fsdp", "--tiny",
            "--llama-configs", "fsdp_tp"]  # fmt: skip
    llama, mlp = _tables(run_benchmark("step_time.py", *args))
    assert [r[0] for r in mlp[1:]] == ["tp", "fsdp"]
    assert "Trainer / hand-written JAX" in mlp[0][3]
    per_device = {r[0]: float(r[-1]) for r in mlp[1:]}
    assert per_device["fsdp"] < per_device["tp"]  # FSDP holds a fraction of the state on each device
    assert [r[:2] for r in llama[1:]] == [["fsdp_tp", "data=4×model=2"]]
    assert llama[1][-1] == "yes"  # the hand-written JAX Llama computes the Trainer's loss


@pytest.mark.slow
def test_llama_train_benchmark_runs(tmp_path):
    out = tmp_path / "llama.json"
    args = ["--preset", "tiny", "--layers", "2", "--variants", "fsdp_tp+bf16+scan+remat", "--steps", "1",
            "--warmup", "0", "--torch", "--compile-layers", "2,4", "--json", str(out)]  # fmt: skip
    stdout = run_benchmark("llama_train.py", *args)
    assert "| fsdp_tp+bf16+scan+remat | data=4×model=2 |" in stdout
    assert "eager torch (cpu, own process)" in stdout and "scanned first-step trace+compile" in stdout
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["tokens_per_s"] > 0 and row["temp_mib"] > 0 and 0 < row["tflops"] < result["peak"][0]
    assert [c["layers"] for c in result["compile"]] == [2, 4]


@pytest.mark.slow
def test_pipeline_benchmark_runs(tmp_path):
    out = tmp_path / "pipeline.json"
    stdout = run_benchmark("pipeline.py", "--tiny", "--json", str(out))
    assert "| gpipe S=4 | stage=4×data=2 |" in stdout and "| circular S=4 r=2 | stage=4 |" in stdout
    result = json.loads(out.read_text())
    memory = {r["config"]: r for r in result["memory"]}
    assert list(memory) == ["unpipelined", "gpipe S=4", "circular S=2 r=2", "1f1b S=4", "1f1b_remat S=4"]  # --tiny's
    assert memory["gpipe S=4"]["param_ratio"] <= 0.45  # a quarter of the blocks per device
    assert memory["1f1b_remat S=4"]["temp_vs_gpipe"] <= 0.6  # one micro-batch's activations per stage, not M
    assert memory["1f1b S=4"]["temp_vs_gpipe"] < 1  # 2S-1 micro-batches' activations per stage, not M+S-1
    assert memory["circular S=2 r=2"]["bubble"] == pytest.approx(1 / (2 * 4 + 1))
    assert [r["config"] for r in result["bubble"]] == ["gpipe S=4", "circular S=4 r=2", "1f1b S=4"]  # --tiny's
    assert all("measured_bubble" in r for r in result["bubble"])  # one tiny round: its sign is noise


@pytest.mark.slow
def test_pipeline_benchmark_counts_fsdp_traffic_per_step(tmp_path):
    out = tmp_path / "comm.json"
    stdout = run_benchmark("pipeline.py", "--tiny", "--comm", "--json", str(out))
    assert "| config | bytes/step over data (MiB) |" in stdout
    rows = {r["config"]: r for r in json.loads(out.read_text())["communication"]}
    assert list(rows) == ["unpipelined", "unpipelined data=8", "gpipe", "1f1b", "1f1b_remat", "circular r=2",
                          "zero_bubble"]  # fmt: skip
    assert rows["1f1b"]["flops_vs_gpipe"] <= 1.05 and rows["1f1b"]["recompute_flops"] == 0
    # no weight gradient is a placeholder: (F + B) / (F + B + W) of gpipe's waste, in 1F1B's memory and the stash
    assert rows["zero_bubble"]["wasted_vs_gpipe"] == pytest.approx(2 / 3, abs=0.03)
    assert rows["zero_bubble"]["temp_vs_1f1b"] <= 1.25
    for name in (
        "gpipe",
        "1f1b",
        "1f1b_remat",
        "circular r=2",
        "zero_bubble",
    ):  # gathered and reduced once per step, not per iteration
        assert rows[name]["off_stage"] <= 1.1 * rows["unpipelined"]["off_stage"], (name, rows[name]["per_axes"])
        assert rows[name]["flops"] > rows["unpipelined data=8"]["flops"]  # the bubble's placeholder micro-batches
        # the compiled loop's wasted share of FLOPs is the formula's bubble (the optimizer's and the loss's FLOPs
        # outside the loop, and the loop's hand-ons, are the difference)
        assert rows[name]["compiled_bubble"] == pytest.approx(rows[name]["bubble"], abs=0.05), name


@pytest.mark.slow
def test_pipeline_memory_benchmark_runs(tmp_path):
    out = tmp_path / "pipeline_memory.json"
    run_benchmark("pipeline_memory.py", "--tiny", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == ["replicated data=8", "pipelined stage=4×data=2"]
    assert all(r["peak_rss_kib"] >= r["constructed_rss_kib"] >= r["model_built_rss_kib"] > 0 for r in rows)
    assert rows[1]["step_argument_bytes"] < rows[0]["step_argument_bytes"]  # a quarter of the layers per device


@pytest.mark.slow
def test_moe_benchmark_runs(tmp_path):
    out = tmp_path / "moe.json"
    run_benchmark("moe.py", "--tiny", "--json", str(out))
    rows = {r["dispatch"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["gspmd", "all_to_all (dropless)", "all_to_all capacity 1.25"]
    # the same model and batch: dropless all-to-all computes gspmd's loss, and moves at most half its bytes
    assert rows["all_to_all (dropless)"]["first_loss"] == pytest.approx(rows["gspmd"]["first_loss"], rel=1e-5)
    assert rows["all_to_all (dropless)"]["bytes"] <= 0.5 * rows["gspmd"]["bytes"]
    assert rows["all_to_all (dropless)"]["all_to_all_bytes"] > 0


@pytest.mark.slow
def test_evaluate_benchmark_runs(tmp_path):
    out = tmp_path / "evaluate.json"
    stdout = run_benchmark("evaluate.py", "--tiny", "--json", str(out))
    result = json.loads(out.read_text())
    assert set(result["median_s"]) == {"eager loop", "evaluate"} and result["speedup"] > 0
    assert sum(line.startswith("batch:") for line in stdout.splitlines()) == len(result["losses"]) == 2
    # the same loss both ways: one f32 computation, fused differently, so within a few f32 ulps (relative 1e-6);
    # printed to 6 decimals they once differed in the last digit (5.372610 and 5.372611)
    assert all(eager == pytest.approx(compiled, rel=1e-6) for eager, compiled in result["losses"])


@pytest.mark.slow
def test_generate_benchmark_runs():
    stdout = run_benchmark("generate.py", "--tiny")  # fails when any way decodes other tokens
    assert "same tokens every way: yes" in stdout
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.splitlines() if line.startswith("| ")]
    assert [r[0] for r in rows[1:]] == [
        "ts.generate, one jitted loop",
        "ts.generate, a compiled step per token",
        "transformers generate, eager on the mesh",
        "transformers generate, eager torch on the CPU",
    ]
    assert all(float(r[1]) > 0 for r in rows[1:])


@pytest.mark.slow
def test_pretrained_benchmark_runs(tmp_path):
    out = tmp_path / "pretrained.json"
    stdout = run_benchmark("pretrained.py", "--tiny", "--repeats", "1", "--json", str(out))
    assert "| from_pretrained + shard |" in stdout and "| load_safetensors (meta + plan) |" in stdout
    result = json.loads(out.read_text())
    # 2 processes × 4 devices: each asks for the slices its own devices hold, about half of every sharded tensor
    assert len(result["fractions"]) == 2 and all(0.4 <= f <= 0.6 for f in result["fractions"])
    assert result["values_equal"] == [1.0, 1.0]  # each process gathered the loaded model: the checkpoint's values
    assert result["load_safetensors"]["seconds"] > 0 and result["from_pretrained"]["rss"] > 0


@pytest.mark.slow
def test_dcp_benchmark_runs(tmp_path):
    out = tmp_path / "dcp.json"
    stdout = run_benchmark("dcp.py", "--tiny", "--repeats", "1", "--json", str(out))
    assert "| dcp.load + shard |" in stdout and "| load_dcp (meta + plan) |" in stdout
    ranks = json.loads(out.read_text())["ranks"]
    assert all(r["equal"] == 1.0 for layout in ranks.values() for r in layout)  # gathered: the saved values
    # a single-rank save is one chunk per tensor, and DCP reads whole chunks: all of it; a sharded save, less
    assert [r["requested"] / r["total"] for r in ranks["single"]] == [1.0, 1.0]
    assert all(r["requested"] < r["total"] for r in ranks["sharded"])
    assert all(0.4 <= r["requested"] / r["total"] <= 0.6 for r in ranks["as_loaded"])  # its own half


@pytest.mark.slow
def test_checkpoint_benchmark_runs(tmp_path):
    out = tmp_path / "checkpoint.json"
    stdout = run_benchmark("checkpoint.py", "--tiny", "--dir", str(tmp_path), "--json", str(out))
    assert "| ts.save |" in stdout and "| background |" in stdout
    result = json.loads(out.read_text())
    assert result["bytes"] > 0 and result["save_vs_disk"] > 0 and result["load_vs_disk"] > 0
    assert set(result["stall"]) == {"step_s", "sync", "background"}
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the benchmark removes what it wrote


@pytest.mark.slow
def test_attention_benchmark_runs():
    stdout = run_benchmark("attention.py", "--tiny")
    expected_flops = float(stdout.split("the tiling's FLOPs: ")[1].split(" G")[0])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.splitlines() if line.startswith("| ")]
    memory = {(r[0], r[1]): r for r in rows if r[1] in ("none", "dots_saveable")}
    for remat in ("none", "dots_saveable"):  # the former lowering saved the scores, the tiled one never does
        tiled, before = memory["tiled (flash)", remat], memory["materialised (before)", remat]
        assert float(tiled[2]) < float(before[2]) / 4, (tiled, before)
    # the scan over tile pairs is weighted by its trip count: every visible pair's 7 dots, no more, no fewer
    assert float(memory["tiled (flash)", "none"][3]) == expected_flops
    speed = [r for r in rows if r[0].startswith("[")]
    assert [r[0] for r in speed] == ["[2, 4, 128, 16]", "[1, 4, 512, 16]"] and all(float(r[3]) > 0 for r in speed)


@pytest.mark.slow
def test_lm_eval_benchmark_runs(tmp_path):
    out = tmp_path / "lm_eval.json"
    stdout = run_benchmark("lm_eval_speed.py", "--tiny", "--json", str(out))  # fails when the metrics differ
    assert "same accuracy and perplexity: yes" in stdout
    result = json.loads(out.read_text())
    assert result["torchshard"]["acc"] == result["hflm"]["acc"] and result["speedup"] > 0


@pytest.mark.slow
def test_metrics_benchmark_runs():
    # one row per device: the FLOPs ratios do not depend on the rows, and the 46 steps take half the time
    args = ["--rounds", "2", "--steps", "10", "--layers", "1", "--seq", "64", "--batch", "8"]
    stdout = run_benchmark("metrics.py", *args)
    cells = {row[0]: row[1:] for row in (line.split("|")[1:-1] for line in stdout.splitlines() if "| " in line)}
    cells = {name.strip(): [c.strip() for c in rest] for name, rest in cells.items()}
    assert 0.95 <= float(cells["HLO: model_flops_per_step × 8"][1]) <= 1.05  # the benchmark checks it as well
    # one attention tile at sequence 64: no recomputed scores, so nothing on top of the model FLOPs
    assert float(cells["HLO: flops_per_step × 8"][1]) == float(cells["HLO: model_flops_per_step × 8"][1])
    assert cells["rows written"] == ["2"]  # steps 10 and 20 of the logged Trainer's rounds (after 3 warm-up steps)


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_variant_in_its_own_process(tmp_path):
    stdout = run_benchmark("gpu.py", "--smoke", "--out", str(tmp_path))
    result = json.loads((tmp_path / "gpu.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    tokamax = ["fsdp+bf16+attn=tokamax"] if importlib.util.find_spec("tokamax") else []  # where it imports
    assert list(rows) == ["eager", "compile", "fsdp+bf16", "fsdp+bf16+attn=tiled", "fsdp+bf16+xla=default",
                          "fsdp+bf16+loss=unfused", "fsdp+bf16+scan+remat=matmuls", "fsdp+bf16+attn=xla",
                          *tokamax]  # fmt: skip
    for name, row in rows.items():
        assert "error" not in row and "skipped" not in row, row
        # where the time went: the top ops (torch.profiler's, or the XLA:CPU thunks jax.profiler traced)
        profile = row["profile"]
        assert 0 < len(profile) <= 15 and "profile_error" not in row, (name, row.get("profile_error"))
        assert all(p["op"] and p["ms"] > 0 and 0 < p["share"] <= 1 for p in profile), profile
        assert sum(p["share"] for p in profile) <= 1.0001 and profile == sorted(profile, key=lambda p: -p["ms"])
        assert row["tokens_per_s"] > 0 and row["mfu"] > 0 and row["peak_bytes"] > 0 and row["compile_s"] >= 0
        assert len(row["losses"]) == 3
        if name != "eager":  # the same weights, batches and AdamW as eager torch: the same bf16 losses
            assert row["losses_match"], (name, row["losses"], rows["eager"]["losses"])
    assert rows["eager"]["platform"] == "cpu" and result["shape"]["layers"] == 2
    assert (tmp_path / "gpu.md").read_text() in stdout
    assert "## Where the time goes" in stdout and "### torchshard fsdp+bf16+attn=xla" in stdout


def _gpu_check(monkeypatch):
    """benchmarks/gpu.py as a module, whose workers fail the test if one is started."""
    from testsupport.helpers import BENCHMARKS

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu = importlib.import_module("gpu")
    monkeypatch.setattr(gpu, "run_variant", lambda *args, **kwargs: pytest.fail("a worker was started"))
    return gpu


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--variants", "eager,fdsp"], "variant 'fdsp': unknown mesh 'fdsp'; give eager, compile, or fsdp+FLAG+..."),
     (["--variants", "fsdp_tp+bf16"], "unknown mesh 'fsdp_tp'; give eager, compile, or fsdp+FLAG+... (one device"),
     (["--variants", "fsdp+bf61"], "variant 'fsdp+bf61': unknown flag 'bf61'; give bf16, scan, remat or KEY=VALUE "
                                   "with KEY one of attn, remat, loss, xla"),
     (["--variants", "fsdp+lose=unfused"], "unknown flag 'lose=unfused'; give bf16, scan, remat or KEY=VALUE"),
     (["--variants", "fsdp+remat=matmul"], "remat='matmul' is not one of dots_saveable, "),
     (["--variants", "fsdp+attn=flash"], "variant 'fsdp+attn=flash': attn='flash' is not one of auto, "),
     (["--variants", "fsdp+loss=fused"], "loss='fused' is not one of unfused"),
     (["--variants", ","], "--variants ',': give one or more of eager, compile, fsdp+bf16"),
     (["--variants", "eager,eager"], "--variants lists eager twice"),
     (["--budget", "0"], "--budget 0.0: give at least 20 seconds for the whole check"),
     (["--budget", "10"], "--budget 10.0: give at least 20 seconds"),
     (["--steps", "0"], "--steps 0: give at least 1 timed steps per variant"),
     (["--warmup", "0"], "--warmup 0: give at least 1 untimed steps, e.g. 2 (the first step compiles"),
     (["--cap", "0"], "--cap 0.0: give seconds > 0 one torchshard variant may take"),
     (["--peak-tflops", "0"], "--peak-tflops 0.0: give the device's dense bf16 TFLOP/s > 0")],
)  # fmt: skip
def test_gpu_check_refuses_bad_options_before_any_worker_starts(monkeypatch, capsys, tmp_path, flags, message):
    gpu, out = _gpu_check(monkeypatch), tmp_path / "out"
    with pytest.raises(SystemExit) as exit:
        gpu.main(["--smoke", "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "1 bad option(s), nothing run" in err and message in err, err
    assert not out.exists()


def test_gpu_check_names_every_bad_option_at_once(monkeypatch, capsys, tmp_path):
    gpu = _gpu_check(monkeypatch)
    with pytest.raises(SystemExit, match="2"):
        gpu.main(["--out", str(tmp_path), "--budget", "0", "--steps", "0", "--variants", "eager,fdsp,fsdp+bf61"])
    err = capsys.readouterr().err
    assert "4 bad option(s)" in err and all(s in err for s in ("--budget 0.0", "--steps 0", "'fdsp'", "'bf61'"))
