"""The plan search: costs with loops counted, hardware profiles, the space and its errors, the ranked result."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
import torch

import torchshard as ts
from testsupport.models import tiny_llama
from torchshard.__main__ import main
from torchshard._base.errors import ArgumentError, ShardingError
from torchshard._hlo.costs import StepCosts, step_costs
from torchshard._hlo.hardware import hardware, load_profiles
from torchshard._hlo.hlo import Collective
from torchshard._search.compile_worker import Compiler
from torchshard._search.estimate import crosses_hosts, estimate, moved_bytes
from torchshard._search.search import (
    FAST_COMPILE,
    Problem,
    _base,
    at_depth,
    compile_layout,
    layout_plan,
    measure,
    rate,
    trainer_options,
)
from torchshard._search.space import ModelDims, SearchLayout, layouts

F32 = np.float32


def _scan(layers):
    f = lambda x, w: jax.lax.scan(lambda c, wi: (jax.numpy.tanh(c @ wi), None), x, w)[0].sum()  # noqa: E731
    x, w = jax.ShapeDtypeStruct((8, 32), F32), jax.ShapeDtypeStruct((layers, 32, 32), F32)
    return jax.jit(jax.grad(f, argnums=1)).lower(x, w).compile()


def test_a_scanned_loop_costs_each_layer_where_xla_counts_one():
    one, eight = step_costs(_scan(2).as_text()), step_costs(_scan(8).as_text())
    per_layer = 3 * 2 * 8 * 32 * 32  # forward, input grad, weight grad
    assert eight.flops - one.flops == 6 * per_layer
    assert _scan(8).cost_analysis()["flops"] == _scan(2).cost_analysis()["flops"]  # what XLA reports instead
    assert eight.bytes_accessed > 3 * one.bytes_accessed


def test_a_loop_over_a_stacked_array_moves_one_slice_per_step():
    """A scan's step reads its layer of the stacked weights, not the whole stack: bytes grow linearly with depth."""
    eight, thirty_two = step_costs(_scan(8).as_text()), step_costs(_scan(32).as_text())
    assert 3.5 * eight.bytes_accessed < thirty_two.bytes_accessed < 4.5 * eight.bytes_accessed


def test_dynamic_slices_and_in_place_updates_move_the_bytes_xla_counts():
    def f(big, small, i):
        return jax.lax.dynamic_update_slice(big, small * 2, (i, 0)), jax.lax.dynamic_slice(big, (i, 0), (8, 64)).sum()

    shapes = [
        jax.ShapeDtypeStruct((4096, 64), F32),
        jax.ShapeDtypeStruct((8, 64), F32),
        jax.ShapeDtypeStruct((), np.int32),
    ]
    compiled = jax.jit(f, donate_argnums=0).lower(*shapes).compile()
    assert step_costs(compiled.as_text()).bytes_accessed == pytest.approx(compiled.cost_analysis()["bytes accessed"],
                                                                          rel=0.01)  # fmt: skip


def test_an_unrolled_program_counts_the_matmul_flops_xla_counts():
    f = lambda x, w1, w2: ((x @ w1) @ w2).sum()  # noqa: E731
    shapes = [jax.ShapeDtypeStruct(s, F32) for s in ((16, 64), (64, 128), (128, 32))]
    compiled = jax.jit(f).lower(*shapes).compile()
    assert step_costs(compiled.as_text()).flops == 2 * 16 * 64 * 128 + 2 * 16 * 128 * 32
    assert step_costs(compiled.as_text()).flops == pytest.approx(compiled.cost_analysis()["flops"], rel=0.05)


def test_collectives_are_counted_per_execution_with_their_axes():
    mesh = ts.make_mesh({"data": 8})
    x = jax.ShapeDtypeStruct((3, 8, 16), F32, sharding=jax.sharding.NamedSharding(mesh, jax.P(None, "data")))
    f = jax.jit(lambda x: jax.lax.scan(lambda c, xi: (c + xi.sum(0), None), jax.numpy.zeros(16), x)[0])
    stats = step_costs(f.lower(x).compile().as_text())
    assert sum(n for op, n in stats.collectives if op.kind == "all-reduce") in (1, 3)  # hoisted or in the loop


def test_moved_bytes_and_host_crossings_follow_ring_algorithms():
    op = Collective("all-reduce", "ar", ("f32[256]",), 1024, ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert moved_bytes(op) == 1024 * 2 * 3 / 4
    assert not crosses_hosts(op, 4) and crosses_hosts(op, 2)
    gather = Collective("all-gather", "ag", ("f32[256]",), 1024, ((0, 4),), axes=("data",))
    parts = estimate(StepCosts(0.0, 0.0, ((gather, 10),)), hardware("h100"), precision="bf16", devices_per_host=4,
                     bubble=0.0).parts  # fmt: skip
    assert parts["comm data"] == pytest.approx(10 * 512 / hardware("h100").inter_host_bandwidth)


def test_hardware_profiles_are_documented_and_extendable(tmp_path):
    for name in ("h100", "a100", "tpu-v5p", "tpu-v5e"):
        hw = hardware(name)
        assert hw.bf16_flops > hw.hbm_bandwidth > 0 and hw.intra_host_bandwidth > hw.inter_host_bandwidth
        assert "TFLOP/s" in hw.source
    path = tmp_path / "hw.json"
    row = {"name": "mygpu", "bf16_flops": 1e15, "fp32_flops": 5e14, "hbm_bandwidth": 4e12, "intra_host_bandwidth": 4e11,
           "inter_host_bandwidth": 5e10, "devices_per_host": 8, "memory_bytes": 2**37}  # fmt: skip
    path.write_text(json.dumps([row]))
    assert hardware("mygpu", extra=load_profiles(path)).memory_bytes == 2**37
    path.write_text(json.dumps([{"name": "broken"}]))
    with pytest.raises(ArgumentError, match=r"entry 0.*each entry needs"):
        load_profiles(path)


def test_an_unknown_hardware_name_lists_the_profiles():
    with pytest.raises(ArgumentError, match=r"unknown hardware 'h10'.*'a100', 'h100'.*did you mean h100"):
        hardware("h10")


LLAMA_ARG = "testsupport.models:tiny_llama"  # MODULE:FACTORY, as users name them
DIMS = ModelDims(layers=4, heads=4, kv_heads=2, experts=None, hidden=64)
OPTIONS = {"microbatches": (1,), "remat": (None,), "scan": (True,), "precision": ("bf16",)}


def test_the_space_has_only_degrees_that_divide_the_model():
    found = layouts(8, DIMS, (8, 32), **OPTIONS)
    meshes = {lay.mesh for lay in found}
    assert all(dict(m)["model"] in (1, 2) and dict(m)["stage"] in (1, 2, 4) for m in meshes)
    assert (("stage", 1), ("data", 8), ("context", 1), ("expert", 1), ("model", 1)) in meshes
    assert all(lay.option("microbatches") == dict(lay.mesh)["stage"] for lay in found if dict(lay.mesh)["stage"] > 1)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", None)])
def test_each_precision_compiles_under_its_own_policy(precision, dtype):
    # plan --search --precisions fp16 compiled every candidate that was not fp32 as bf16
    from torchshard._search import search_compile
    from torchshard._search.space import SearchLayout

    layout = SearchLayout(mesh=(("data", 8),), precision=precision)
    policy = search_compile.trainer_options(tiny_llama(meta=True), layout)["precision"]
    assert (policy.compute_dtype if policy is not None else None) == dtype


def test_pipelined_meshes_are_tried_with_each_schedule_and_the_rest_with_none():
    found = layouts(8, DIMS, (8, 32), schedules=("1f1b", "gpipe"), **OPTIONS)
    piped = [lay for lay in found if lay.degree("stage") > 1]
    assert piped and {lay.option("schedule") for lay in piped} == {"1f1b", "gpipe"}
    assert all(lay.option("schedule") is None for lay in found if lay.degree("stage") == 1)
    assert " pipeline M=2 1f1b " in next(lay for lay in piped if lay.option("schedule") == "1f1b").label() + " "
    with pytest.raises(
        ArgumentError, match=r"schedules=\['zero'\]: choose one or more of \['gpipe', '1f1b', '1f1b_remat', 'zero_b"
    ):
        ts.inspect.search(tiny_llama(meta=True), devices=2, batch=(4, 16), schedules=("zero",), **OPTIONS)


def test_a_batch_no_configuration_splits_names_batch_sizes_and_device_counts():
    want = r"batch 7 splits over no configuration.*nearest batch sizes that work: \[6, 9, 12\]"
    want += r".*nearest device counts that split batch 7: \[1, 2, 7, 14\]"
    with pytest.raises(ShardingError, match=want):
        layouts(6, ModelDims(4, 4, 2, None, 64), (7, 31), **OPTIONS)


@pytest.fixture(scope="module")
def tiny_problem():
    model = tiny_llama(layers=4, meta=True)
    hw = hardware("h100")
    from torchshard._report.fit import lm_loss

    return Problem(model, (8, 16), 4, hw, hw.memory_bytes, 4, lm_loss)


@pytest.mark.slow
def test_unscanned_costs_from_two_shallow_compiles_match_the_full_compile(tiny_problem):
    layout = SearchLayout((("stage", 1), ("data", 2), ("context", 1), ("expert", 1), ("model", 2)), scan=False)
    devices = jax.devices()[:4]
    peak, costs = measure(tiny_problem, layout, devices)
    full_peak, full = compile_layout(tiny_problem, layout, at_depth(tiny_problem.model, 4), devices)
    assert costs.flops == pytest.approx(full.flops, rel=1e-6)
    assert costs.bytes_accessed == pytest.approx(full.bytes_accessed, rel=0.05)
    assert peak == pytest.approx(full_peak, rel=0.15)
    moved = lambda ops: sum(n * op.bytes for op, n in ops)  # noqa: E731  (XLA combines small ones differently)
    assert moved(costs.collectives) == pytest.approx(moved(full.collectives), rel=0.05)


@pytest.mark.slow
def test_gradient_accumulation_with_context_parallelism_counts_every_micro_batch(tiny_problem):
    """The micro-batch loop's body (ring attention loops inside) is weighted by its trip count: no FLOPs go missing.

    (XLA recomputes one more projection under the micro-batch loop here: 2.6% more, never fewer.)
    """
    mesh = (("stage", 1), ("data", 2), ("context", 2), ("expert", 1), ("model", 1))
    accumulating = [SearchLayout(mesh, "nothing_saveable", options=(("grad_accum_steps", k),)) for k in (1, 4)]
    one, four = (compile_layout(tiny_problem, lay, tiny_problem.model, jax.devices()[:4])[1] for lay in accumulating)
    assert one.flops <= four.flops < 1.05 * one.flops


@pytest.mark.slow
def test_a_searched_1f1b_pipeline_compiles_gpipes_flops_in_less_memory(tiny_problem):
    """The search compiles what it names, ``Pipeline(schedule="1f1b")``; with M = 8 > 2S-1 = 3 micro-batches
    1F1B holds fewer activations than gpipe, so its peak is the lower one (and it is compiled first)."""
    # a layer per stage: what sets the schedules apart is the micro-batches each stage holds, not its depth
    problem = dataclasses.replace(tiny_problem, model=tiny_llama(layers=2, meta=True), batch=(8, 64), devices=2)
    mesh = (("stage", 2), ("data", 1), ("context", 1), ("expert", 1), ("model", 1))
    model, devices = problem.model, jax.devices()[:2]
    piped = (("microbatches", 8),)
    one_f, gpipe = (SearchLayout(mesh, None, True, "fp32", (*piped, ("schedule", s))) for s in ("1f1b", "gpipe"))
    assert trainer_options(model, one_f)["pipeline"] == ts.Pipeline(microbatches=8, schedule="1f1b")
    assert _base([gpipe, one_f], {"remat": (None,), "precision": ("fp32",), "schedules": ("gpipe", "1f1b")}) == one_f
    (one_f_peak, one_f_costs), (gpipe_peak, gpipe_costs) = (compile_layout(problem, lay, model, devices)
                                                            for lay in (one_f, gpipe))  # fmt: skip
    assert one_f_costs.flops <= 1.05 * gpipe_costs.flops
    assert one_f_peak < gpipe_peak
    zero = SearchLayout(mesh, None, True, "fp32", (*piped, ("schedule", "zero_bubble")))
    zero_costs = compile_layout(problem, zero, model, devices)[1]
    assert zero_costs.flops < gpipe_costs.flops  # no placeholder weight gradients
    # the estimate's bubble share is the schedule's own (FLOPs scaled up: a tiny step's parts round to 0 s)
    shares = [(c.parts["bubble"] / c.parts["compute"]) for c in (rate(problem, lay, 0, dataclasses.replace(
        costs, flops=costs.flops * 1e9)) for lay, costs in ((zero, zero_costs), (gpipe, gpipe_costs)))]  # fmt: skip
    assert shares == pytest.approx([2 / 26, 1 / 9], rel=1e-3)  # 2(S-1)/(3M+2(S-1)), (S-1)/(M+S-1)


@pytest.mark.slow
def test_the_search_ranks_fitting_configurations_and_its_best_fits_by_plan_compile(capsys):
    model = tiny_llama(layers=3, meta=True)
    found = ts.inspect.search(model, devices=4, batch=(8, 18), max_compiles=4, **OPTIONS)
    compiled = [c for c in found if c.peak_bytes is not None]
    assert compiled and compiled[0].fits and compiled[0].step_seconds > 0 and 0 < compiled[0].mfu < 1
    assert [c.step_seconds for c in compiled if c.fits] == sorted(c.step_seconds for c in compiled if c.fits)
    best = compiled[0]
    mesh = {"data": best.mesh["data"], "model": best.layout.degree("model")}
    argv = ["plan", LLAMA_ARG, "--mesh", ",".join(f"{a}={n}" for a, n in mesh.items()), "--preset",
            "hf", "--compile", "--batch", "8x18", "--scan", "--precision", "bf16", "--device-memory",
            str(best.peak_bytes * 2), "--format", "json"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["device_memory"]["fits"]
    assert set(best.to_json()) >= {"mesh", "options", "peak_bytes", "fits", "step_seconds", "tokens_per_second", "mfu"}


@pytest.mark.slow
def test_the_search_compiles_without_llvm_optimisation_to_the_same_program_and_memory(tiny_problem):
    import optax

    from torchshard._trainer.abstract import AbstractTrainer

    layout = SearchLayout(
        (("stage", 1), ("data", 2), ("context", 1), ("expert", 1), ("model", 2)), remat="dots_saveable"
    )
    model = tiny_problem.model
    planned = layout_plan(model, layout, jax.devices()[:4])
    trainer = AbstractTrainer(model, tiny_problem.loss_fn, optax.adamw(1e-4), planned, **trainer_options(model, layout))
    lowered = trainer.lower(torch.empty(tiny_problem.batch, dtype=torch.int64, device="meta"))
    fast, full = lowered.compile(FAST_COMPILE), lowered.compile({"xla_backend_optimization_level": 3})
    assert fast.as_text() == full.as_text()  # the optimised HLO, its sharding, collectives and buffers
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    memory = [tuple(getattr(c.memory_analysis(), f) for f in fields) for c in (fast, full)]
    assert memory[0] == memory[1] and memory[0][2] > 0


def test_search_cli_errors_name_the_fix(capsys):
    assert main(["plan", LLAMA_ARG, "--search", "--batch", "8x16"]) == 2
    assert "--search needs --devices N" in capsys.readouterr().err
    assert main(["plan", LLAMA_ARG, "--search", "--devices", "4", "--batch", "8x16", "--hardware",
                 "b200"]) == 2  # fmt: skip
    assert "unknown hardware 'b200'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["plan", LLAMA_ARG])
    assert "--mesh (or use --search)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--devices", "0", "0 is out of range"), ("--devices", "-4", "-4 is out of range"),
     ("--devices", "four", "'four' is not an integer"), ("--hosts", "0", "0 is out of range"),
     ("--max-compiles", "0", "0 is out of range")],
)  # fmt: skip
def test_search_counts_below_one_are_usage_errors_naming_the_flag(capsys, flag, value, message):
    flags = {"--devices": "4", "--hosts": "1"} | {flag: value}
    with pytest.raises(SystemExit, match="2"):
        main(["plan", LLAMA_ARG, "--search", "--batch", "8x16", *(x for f in flags.items() for x in f)])
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}; give a count >= 1" in err and "use_cpu_devices" not in err


SEARCH = ["plan", LLAMA_ARG, "--search", "--devices", "4", "--batch", "8x16"]


def _searched(monkeypatch) -> list[dict]:
    """The keywords the CLI calls the search with (it returns no candidate); a test that expects none gets none."""
    from torchshard._search import search_cli

    calls: list[dict] = []
    monkeypatch.setattr(search_cli, "search", lambda model, **kwargs: calls.append(kwargs) or [])
    return calls


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--microbatches", "0"], "--microbatches '0': '0' not counts >= 1; give counts such as 1,2,4"),
     (["--microbatches", "1,-2,x"], "--microbatches '1,-2,x': '-2', 'x' not counts >= 1"),
     (["--hosts", "3"], r"--hosts 3 does not divide --devices 4; give one of \[1, 2, 4\]"),
     (["--device-memory", "0"], "--device-memory '0' is 0 bytes; give a device's memory, e.g. 80GiB"),
     (["--device-memory", "0.5"], "--device-memory '0.5' is 0 bytes"),
     (["--remat-policies", "none,dots"], "--remat-policies 'none,dots': 'dots' not among them; choose one or more "
                                         "of none,.*,matmuls"),
     (["--precisions", ","], "--precisions ',': no value; choose one or more of bf16"),
     (["--scans", "maybe"], "--scans 'maybe': 'maybe' not among them; choose one or more of true,false"),
     (["--schedules", "zb"], "--schedules 'zb': 'zb' not among them; choose one or more of gpipe,1f1b")],
)  # fmt: skip
def test_search_flags_are_usage_errors_before_the_search_starts(capsys, monkeypatch, flags, message):
    calls = _searched(monkeypatch)
    assert main([*SEARCH, *flags]) == 2
    assert re.search(message, capsys.readouterr().err) and calls == []


def test_every_bad_search_flag_is_named_in_one_message(capsys, monkeypatch):
    calls = _searched(monkeypatch)
    flags = ["--microbatches", "0", "--hosts", "3", "--device-memory", "0", "--remat-policies", "dots"]
    assert main([*SEARCH, *flags]) == 2
    err = capsys.readouterr().err
    assert "plan --search: 4 bad flag(s)" in err and calls == []
    assert all(f"  - {flag}" in err for flag in ("--microbatches", "--hosts 3", "--device-memory", "--remat-policies"))


def test_search_tries_every_policy_remat_takes(capsys, monkeypatch):
    from torchshard._train.remat import POLICY_NAMES

    calls = _searched(monkeypatch)
    main([*SEARCH, "--remat-policies", ",".join(["none", *POLICY_NAMES]), "--hosts", "2", "--device-memory", "1GB"])
    assert calls[0]["remat"] == (None, *POLICY_NAMES) and "matmuls" in POLICY_NAMES
    assert (calls[0]["hosts"], calls[0]["device_memory"]) == (2, 10**9)
    ts.Remat("layers", policy="matmuls")  # the policy the search now offers is one Remat takes


FAULTY = {"microbatches": (1, 2, 4), "remat": (None,), "scan": (True,), "precision": ("bf16",)}


def _assert_failures_recorded(found, *, abort: str, raised: str) -> None:
    notes = {c.layout.splits: c.note for c in found}
    assert notes[2].startswith(abort) and notes[4] == raised, notes  # 4 after the abort: a fresh compiling process
    assert found[0].layout.splits == 1 and found[0].fits and found[0].step_seconds > 0


@pytest.mark.slow
def test_the_search_records_candidates_that_raise_or_abort_as_failed_and_ranks_the_rest(caplog, monkeypatch):
    from testsupport.search_faults import faulty_llama

    with torch.device("meta"):
        model = faulty_llama()
    found = ts.inspect.search(model, devices=2, batch=(8, 15), max_compiles=4, **FAULTY)
    abort = "failed: the compiling process was killed by SIGABRT: hlo_instruction.cc:1] injected check failure"
    _assert_failures_recorded(found, abort=abort, raised="failed: RuntimeError: injected failure at 2 rows")
    assert f"plan search: data=2 accum=2 scan bf16 failed to compile: {abort[8:]}" in caplog.text
    with monkeypatch.context() as m:  # another hardware: ranked again from what was measured, failures included
        m.setattr(Compiler, "_spawn", lambda self: pytest.fail("the second search started a compile"))
        again = ts.inspect.search(model, devices=2, batch=(8, 15), max_compiles=4, hardware_name="a100", **FAULTY)
    assert [c.note for c in again] == [c.note for c in found] and again[0].step_seconds != found[0].step_seconds


@pytest.mark.slow
def test_a_search_whose_loss_cannot_be_sent_to_a_child_compiles_here_and_records_errors_as_failed(caplog):
    from testsupport.search_faults import faulty_llama

    def loss(model, ids):  # a local function: pickle cannot send it
        if ids.shape[0] != 8:
            raise ValueError(f"no micro-batches here ({ids.shape[0]} rows)")
        return model(input_ids=ids, labels=ids).loss

    with torch.device("meta"):
        model = faulty_llama()
    found = ts.inspect.search(model, devices=2, batch=(8, 15), loss_fn=loss, max_compiles=2, **FAULTY)
    assert "compiling in this process, as the model or loss cannot be sent to a child" in caplog.text
    assert found[0].layout.splits == 1 and found[0].fits
    assert found[1].note == "failed: ValueError: no micro-batches here (4 rows)"


@pytest.mark.slow
def test_plan_search_survives_candidates_that_fail_to_compile_and_exits_0(capsys):
    argv = ["plan", "testsupport.search_faults:faulty_llama", "--search", "--devices", "2", "--batch", "8x15",
            "--microbatches", "1,2,4", "--remat-policies", "none", "--scans", "true", "--precisions", "bf16",
            "--max-compiles", "4"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"3 configurations .* 1 compiled, 2 failed", out), out
    assert re.search(r"^  1 .* yes .*\n  2 .* failed: .*\n  3 .* failed: ", out, re.MULTILINE), out
    assert "failed: the compiling process was killed by SIGABRT" in out
    assert "failed: RuntimeError: injected failure at 2 rows" in out


def test_at_depth_rebuilds_a_transformers_model_on_meta():
    shallow = at_depth(tiny_llama(layers=4, meta=True), 1)
    assert shallow.config.num_hidden_layers == 1 and next(shallow.parameters()).device == torch.device("meta")


@pytest.mark.slow
def test_the_search_benchmark_runs_tiny():
    from testsupport.helpers import run_benchmark

    # two compiles (its compile worker started, then reused) are a smoke run; the tests above search further
    stdout = run_benchmark("search.py", "--tiny", "--max-compiles", "2")
    assert "search: " in stdout and " compiled, " in stdout
