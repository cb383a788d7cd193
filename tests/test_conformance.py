"""The conformance matrix (tools/conformance.py): one row run here, and how the script judges and records cells."""

from __future__ import annotations

import dataclasses
import doctest
import json
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

import torchshard as ts
from tools import capabilities, cells, combos, conformance, rotation, tiny
from tools.capabilities import run_family
from tools.cells import Cell, Work, eager, losses_cell, noisy_losses_cell, run_cell
from tools.families import DENSE, MOE, REPRESENTATIVE, XLA_DEFAULTS, build, causal_lm_types, family

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.mark.slow
def test_one_row_llama_is_within_tolerance_or_refused_in_every_column():
    cells = dict(run_family("llama"))
    assert cells.pop("kind").text == "dense"
    assert list(cells) == [c.key for c in capabilities.COLUMNS]
    wrong = {k: c.render() for k, c in cells.items() if c.status not in ("ok", "refused", "n/a")}
    assert wrong == {}
    assert cells["train"].status == "ok" and cells["generate"].text == "= eager"  # it ran, not refused
    assert {k for k, c in cells.items() if c.status == "n/a"} == {"a2a", "bf16", "cp_a2a", "pp_a2a"}  # MoE columns


@pytest.fixture
def toy_schedule():
    """A pipeline schedule registered for one test (it runs no step: its column is only listed)."""
    from torchshard._strategies.pipeline.schedule import SCHEDULES, Schedule, register

    schedule = register(Schedule(name="toy_rounds", summary="a toy taking rounds", repeats=True))
    yield schedule
    del SCHEDULES[schedule.name]


def test_a_schedule_registered_at_runtime_gets_its_matrix_column(toy_schedule):
    from torchshard._strategies.pipeline.schedule import SCHEDULES

    columns = combos.combos()
    assert [key for key in columns if key[3:] in SCHEDULES] == [f"pp_{name}" for name in SCHEDULES]
    title, truth, capability = columns["pp_toy_rounds"]
    assert title == "PP toy_rounds" and "repeats=2" in truth and "4 layers" in truth  # it takes rounds
    assert capability.__name__ == "pipeline_toy_rounds"


def test_the_matrix_has_a_column_for_every_schedule_torchshard_registers():
    from torchshard._strategies.pipeline.schedule import SCHEDULES

    assert {f"pp_{name}" for name in SCHEDULES} <= {column.key for column in capabilities.COLUMNS}


def test_every_family_the_suite_trains_is_enumerated():
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    trained = {f.model_type for f in DENSE + MOE}
    if Version(transformers.__version__) < Version("5.23"):  # the floor lane's 5.17 predates kolibri1, flint, ...:
        trained &= set(CONFIG_MAPPING_NAMES)  # the pinned lane (5.23) checks those
    assert trained <= set(causal_lm_types())


@pytest.mark.parametrize("model_type", ["blt", "kimi_linear"])
def test_families_sized_by_fields_of_their_own_build_tiny(model_type):
    # tools.tiny's names miss these fields; kimi_linear built with its default delta attention (a 12,288-wide
    # conv beside hidden 64) needed 15 GB in its MoE all-to-all cell and was killed
    model = build(family(model_type))
    widest = max((max(p.shape), name) for name, p in model.named_parameters())
    assert widest[0] <= 32 * 64, widest  # 32 times the tiny hidden size


def test_families_without_a_row_say_why():
    assert dict(run_family("gemma3"))["skipped"].text.startswith("not a text-only causal LM")
    assert dict(run_family("bert"))["skipped"].text.startswith("not causal: its eager logits change")


def _raises(error: Exception, *, after_work: bool = False):
    def capability(row, work: Work) -> Cell:
        work.began = after_work
        raise error

    return capability


@pytest.mark.parametrize(
    ("capability", "rendered"),
    [
        (_raises(ts.ShardingError("no plan:\n  q_proj: 3 heads")), "refused: ShardingError: no plan: q_proj: 3 heads"),
        (_raises(ts.ArgumentError("bad ids"), after_work=True), "✗ typed error after work began: ArgumentError: bad"),
        (_raises(RuntimeError("Boolean value of Tensor")), "✗ RuntimeError: Boolean value of Tensor"),
        (lambda row, work: eager(lambda: 1 / 0), "— no truth: eager torch fails (ZeroDivisionError"),
        (lambda row, work: Cell("ok", "1.0e-07"), "✓ 1.0e-07"),
    ],
    ids=["typed-first", "typed-after-work", "untyped", "no-truth", "ok"],
)
def test_a_cell_is_a_refusal_only_for_a_typed_error_before_any_result(capability, rendered):
    assert run_cell(capability, None).render().startswith(rendered)


def test_a_cell_quotes_torchshard_warnings_but_not_unused_rules():
    def capability(row, work):
        import warnings

        warnings.warn("plan rule matched nothing", ts.UnusedRuleWarning, stacklevel=1)
        warnings.warn("ring attention skipped for Gemma2", ts.ExpertDispatchWarning, stacklevel=1)
        return Cell("ok", "0.0e+00")

    assert run_cell(capability, None).render() == "✓ 0.0e+00 (warned: ring attention skipped for Gemma2)"


def test_losses_over_the_tolerance_are_a_failure():
    assert losses_cell([1.0, 2.0], [1.0, 2.0002], 1e-4).render() == "✓ 1.0e-04"
    failed = losses_cell([1.0, 2.0], [1.0, 2.001], 1e-4)
    assert failed.render() == "✗ losses differ by 5.0e-04 (rtol 0.0001)"
    assert losses_cell([float("nan")], [1.0], 1e-4).status == "fail"


def test_a_bf16_difference_within_eagers_own_spread_is_no_verdict_and_beyond_it_a_failure():
    def never() -> list[list[float]]:
        raise AssertionError("eager's second run is only needed over the tolerance")

    assert noisy_losses_cell([1.0, 2.001], [1.0, 2.0], 1e-3, never).render() == "✓ 5.0e-04"
    noisy = noisy_losses_cell([1.0, 2.004], [1.0, 2.0], 1e-3, lambda: [[1.0, 2.0], [1.0, 2.0016]])  # ≤ 4 × 8e-4
    assert noisy.status == "n/a" and "losses differ by 2.0e-03" in noisy.text
    assert noisy_losses_cell([1.0, 2.004], [1.0, 2.0], 1e-3, lambda: [[1.0, 2.0002]]).status == "fail"  # > 4 × 1e-4
    assert noisy_losses_cell([1.0, float("nan")], [1.0, 2.0], 1e-3, lambda: [[1.0, 2.5]]).status == "fail"


def test_a_slice_checks_every_nth_family_and_the_representative_ones_and_writes_no_committed_table():
    names = causal_lm_types()
    thirds = [set(rotation.sliced(names, k, 3)) for k in range(3)]
    assert set().union(*thirds) == set(names) and sum(map(len, thirds)) == len(names)  # three commits: every row
    args = conformance._parser().parse_args(["--slice", "1/3"])
    assert conformance.destinations(args) == (None, None)
    with pytest.raises(ValueError, match=r"--slice '3/3': K/N with 0 <= K < N"):
        rotation.parse_slice("3/3")


def test_a_slice_first_rechecks_the_families_the_change_since_the_baseline_names(tmp_path):
    def git(*args):
        who = ["-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", *who, *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "fix.py").write_text("x = 1\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "conformance.md").write_text("| llama |\n")
    git("add", ".")
    git("commit", "-qm", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    (tmp_path / "fix.py").write_text("x = 2  # Apertus' XIELU reads a buffer; hf_qwen2 is a test model\n")
    (tmp_path / "docs" / "conformance.md").write_text("| llama | mixtral |\n")  # the table itself names none
    families = ["apertus", "llama", "mixtral", "qwen2"]
    assert rotation.touched(families, base, repo=tmp_path) == ["apertus"]
    assert rotation.touched(families, "0" * 40, repo=tmp_path) == []  # a commit the clone lacks names none


def test_the_docstring_examples_of_the_tools_run():
    for module in (cells, conformance, rotation, tiny):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.attempted and not result.failed, module.__name__


# a stand-in worker: answers one family with one cell, then dies the way XLA's checks do (or hangs)
FAKE_WORKER = textwrap.dedent("""
    import json, os, sys, time
    name = sys.stdin.readline().strip()
    cell = {"status": "ok", "text": "1.0e-07", "seconds": 0.1}
    print(json.dumps({"family": name, "start": "train"}), flush=True)
    print(json.dumps({"family": name, "key": "train", "cell": cell}), flush=True)
    print(json.dumps({"family": name, "start": "bf16"}), flush=True)
    print("F0000 hlo_instruction.cc:1234] Invalid binary instruction opcode copy", file=sys.stderr, flush=True)
    time.sleep(60) if sys.argv[1] == "hang" else os.abort()
""")


@pytest.mark.parametrize(
    ("how", "why"),
    [("abort", "crashed (killed by SIGABRT)"), pytest.param("hang", "timed out after 3 s", marks=pytest.mark.slow)],
)
def test_a_worker_that_dies_or_hangs_fails_its_familys_remaining_cells(how, why):
    worker = conformance.Worker(None, command=[sys.executable, "-c", FAKE_WORKER, how])
    result, usable = conformance._run_one(worker, "mixtral", ["train", "bf16", "lora"], timeout=3)
    worker.stop()
    assert not usable
    assert result.cells["train"]["status"] == "ok"
    died, after = result.cells["bf16"], result.cells["lora"]  # it died in bf16; lora never ran
    assert died["status"] == "fail" and died["text"].startswith(why), died
    assert ("Invalid binary instruction opcode copy" in died["text"]) == (how == "abort")  # a hang has no message
    assert after == {"status": "fail", "text": f"not run: the worker {why} in bf16", "seconds": 0.0}


def _report(cells: dict) -> dict:
    result = conformance.Result(kind="MoE", seconds=1.0, cells=cells)
    skipped = conformance.Result(skipped="not causal")
    families = {"mixtral": dataclasses.asdict(result), "bert": dataclasses.asdict(skipped)}
    return {"command": "python3 dev.py conformance", "date": "today", "seconds": 60.0, "jobs": 2,
            "versions": {"torch": "2"}, "xla_flags": "", "families": families}  # fmt: skip


def test_the_table_goes_between_the_markers_and_check_counts_the_failures(tmp_path):
    cells = {"train": {"status": "ok", "text": "1.0e-07"}, "bf16": {"status": "fail", "text": "crashed | SIGABRT"}}
    report = _report(cells)
    page = tmp_path / "conformance.md"
    page.write_text(f"# Title\n\nkept\n\n{conformance.BEGIN}\nold\n{conformance.END}\n\nkept too\n")
    conformance.write_markdown(page, conformance.render(report))
    text = page.read_text()
    assert text.startswith("# Title\n\nkept\n\n") and text.endswith("\n\nkept too\n") and "old" not in text
    assert "| mixtral | MoE | 1 | ✓ 1.0e-07 |" in text and "✗ crashed \\| SIGABRT" in text
    assert "| bert |  | 0 | skipped: not causal |" in text
    assert "python3 dev.py conformance" in text and "rtol" in text  # the command and the tolerances
    assert conformance.failures(json.loads(json.dumps(report))["families"]) == ["mixtral/bf16"]


@pytest.mark.parametrize(
    ("argv", "written"),
    [
        ([], (conformance.DOC, conformance.DATA)),
        (["--check"], (conformance.DOC, conformance.DATA)),
        (["--check", "--baseline", "docs/conformance.json", "--skip-slower", "240"], (None, None)),
        (["--baseline", "b.json", "--out", "o.md"], (conformance.Path("o.md"), None)),
        (["--families", "llama"], (None, None)),
    ],
)
def test_a_check_against_the_baseline_leaves_the_committed_table_alone(argv, written):
    assert conformance.destinations(conformance._parser().parse_args(argv)) == written


def test_a_check_prints_why_each_new_failure_failed(tmp_path, monkeypatch, capsys):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(_report({"train": {"status": "ok", "text": "1.0e-07"}})))
    why = "losses differ by 1.0e-02 (rtol 0.0001)"
    ran = conformance.Result(kind="MoE", seconds=1.0, cells={"train": {"status": "fail", "text": why}})
    monkeypatch.setattr(conformance, "run_pool", lambda names, keys, **kwargs: {"mixtral": ran})
    argv = ["--families", "mixtral", "--only", "train", "--check", "--baseline", str(baseline)]
    assert conformance.main(argv) == 1
    out, err = capsys.readouterr()
    assert f"  mixtral/train: {why}" in err.splitlines()
    assert "| mixtral | MoE |" in out  # a check of some rows still shows them, as no file takes them


def test_a_slice_runs_the_representative_rows_before_its_rotating_part_and_names_what_the_budget_left(
    tmp_path, monkeypatch, capsys
):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(_report({"train": {"status": "ok", "text": "1.0e-07"}})))
    started = []
    monkeypatch.setattr(conformance, "run_pool", lambda names, keys, **kwargs: started.extend(names) or {})
    conformance.main(["--slice", "1/4", "--check", "--baseline", str(baseline), "--only", "train"])
    assert started[: len(REPRESENTATIVE)] == list(REPRESENTATIVE)  # a budget cuts the rotating part first
    assert len(started) > len(REPRESENTATIVE)
    assert f"not started within --budget inf s: {', '.join(started)}" in capsys.readouterr().out


# a stand-in worker that answers each family with the XLA set-up it was started with
ENV_WORKER = textwrap.dedent("""
    import json, os, sys
    for line in sys.stdin:
        name, env = line.strip(), os.environ
        text = f"defaults={env.get('TORCHSHARD_TEST_XLA_DEFAULTS', '')} chosen={'_TORCHSHARD_TEST_XLA_FLAGS' in env}"
        cell = {"status": "ok", "text": text, "seconds": 0.0}
        print(json.dumps({"family": name, "key": "train", "cell": cell}), flush=True)
        print(json.dumps({"family": name, "done": 0.0, "cpu": 0.0}), flush=True)
""")


def test_families_that_need_xlas_defaults_run_in_a_worker_started_with_them(monkeypatch):
    class EnvWorker(conformance.Worker):
        def __init__(self, keys, command=None, *, xla_defaults=False):
            super().__init__(keys, [sys.executable, "-c", ENV_WORKER], xla_defaults=xla_defaults)

    monkeypatch.setattr(conformance, "Worker", EnvWorker)
    monkeypatch.setenv("_TORCHSHARD_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")
    monkeypatch.delenv("TORCHSHARD_TEST_XLA_DEFAULTS", raising=False)
    assert "xlstm" in XLA_DEFAULTS and "llama" not in XLA_DEFAULTS
    results = conformance.run_pool(["llama", "xlstm", "gemma"], ["train"], jobs=1, timeout=60, done=lambda r: None)
    texts = {name: r.cells["train"]["text"] for name, r in results.items()}
    fast, defaults = "defaults= chosen=True", "defaults=1 chosen=False"
    assert texts == {"llama": fast, "xlstm": defaults, "gemma": fast}


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--budget", "0"], "--budget 0: give seconds after which no family starts, e.g. 900 (0 would start none)"),
     (["--budget", "-5"], "--budget -5: give seconds after which no family starts"),
     (["--timeout", "0"], "--timeout 0: give seconds one family may take, e.g. 900"),
     (["--timeout", "inf"], "--timeout inf: give a number of seconds, e.g. 900"),
     (["--jobs", "0"], "--jobs 0: give a number of worker processes >= 1, e.g. 2"),
     (["--skip-slower", "0", "--baseline", "docs/conformance.json"], "--skip-slower 0: give CPU seconds over which"),
     (["--skip-slower", "240"], "--skip-slower reads each row's time from --baseline: add --baseline"),
     (["--slice", "4/4"], "--slice '4/4': give K/N with 0 <= K < N, or commit/N, e.g. 0/4 or commit/4"),
     (["--slice", "commit/0"], "--slice 'commit/0': give K/N with 0 <= K < N"),
     (["--slice", "one/4"], "--slice 'one/4': give K/N with 0 <= K < N"),
     (["--families", "lama"], "--families: 'lama' is no causal LM of the installed transformers; closest: ['llama'"),
     (["--only", "trian"], "--only: 'trian' is no column; choose from train,"),
     (["--baseline", "no/such.json"], "--baseline 'no/such.json': no such file; give a results JSON")],
)  # fmt: skip
def test_bad_arguments_are_refused_before_anything_runs_or_is_written(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(conformance, "run_pool", lambda *args, **kwargs: pytest.fail("a family ran"))
    monkeypatch.setattr(conformance, "_write", lambda *args, **kwargs: pytest.fail("a table was written"))
    with pytest.raises(SystemExit) as exit:
        conformance.main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "1 bad argument(s), nothing run or written" in err and message in err, err


def test_every_bad_argument_is_named_in_one_message(monkeypatch, capsys):
    monkeypatch.setattr(conformance, "run_pool", lambda *args, **kwargs: pytest.fail("a family ran"))
    with pytest.raises(SystemExit, match="2"):
        conformance.main(["--budget", "0", "--jobs", "0", "--timeout", "-1", "--families", "llama,lama"])
    err = capsys.readouterr().err
    assert "4 bad argument(s)" in err and all(f in err for f in ("--budget 0", "--jobs 0", "--timeout -1", "'lama'"))


def test_a_run_that_starts_no_family_writes_nothing_and_fails(tmp_path, capsys):
    out, data = tmp_path / "conformance.md", tmp_path / "conformance.json"
    argv = ["--families", "llama", "--budget", "1e-9", "--out", str(out), "--json", str(data)]
    assert conformance.main(argv) == 1  # the real pool: its budget is spent before the first family starts
    captured = capsys.readouterr()
    assert "1 families not started within --budget 0 s: llama" in captured.out
    assert "no family ran (see above); nothing written or checked" in captured.err
    assert not out.exists() and not data.exists()


def test_a_check_that_leaves_out_every_family_fails(tmp_path, monkeypatch, capsys):
    rows = {n: {"skipped": "", "cpu_seconds": 900.0, "cells": {"train": {"status": "ok"}}} for n in causal_lm_types()}
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"families": rows}))
    monkeypatch.setattr(conformance, "run_pool", lambda *args, **kwargs: pytest.fail("a family ran"))
    argv = ["--check", "--baseline", str(baseline), "--skip-slower", "240", "--only", "train"]
    assert conformance.main(argv) == 1
    assert "no family left to run (see above why each was left out); nothing written" in capsys.readouterr().err


def test_a_check_that_compared_no_cell_fails(monkeypatch, capsys):
    skipped = conformance.Result(skipped="not a text-only causal LM")
    monkeypatch.setattr(conformance, "run_pool", lambda names, keys, **kwargs: {"gemma3": skipped})
    assert conformance.main(["--families", "gemma3", "--check"]) == 1
    err = capsys.readouterr().err
    assert "no cell was compared, so nothing is checked; every family was skipped: gemma3 (not a text-only" in err
