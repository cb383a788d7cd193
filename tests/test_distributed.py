"""Multi-process runs: initialize() resolution, the local launcher, and 1×8 vs 2×4 training parity."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec

import torchshard
from testsupport.helpers import assert_close, assert_trees_close, root_env
from torchshard import ShardingError, distributed, launch
from torchshard._multihost import runtime as _distributed
from torchshard._multihost import worker as _worker

TESTS = Path(__file__).parent
ROOT = TESTS.parent
ENV_NAMES = (
    distributed.COORDINATOR_ENV,
    distributed.NUM_PROCESSES_ENV,
    distributed.PROCESS_ID_ENV,
    distributed.CPU_DEVICES_ENV,
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_PROCID",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_SIZE",
    "TPU_WORKER_HOSTNAMES",
    "TORCHSHARD_CLUSTER",
)
SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
LAUNCH_ENV = {
    distributed.COORDINATOR_ENV: "127.0.0.1:5000",
    distributed.NUM_PROCESSES_ENV: "2",
    distributed.PROCESS_ID_ENV: "1",
}


# --- resolve(): where the setup comes from -------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "environ", "expected"),
    [
        ({}, {}, distributed.ProcessGroup("single")),
        (
            {"coordinator_address": "h:1", "num_processes": 2, "process_id": 0},
            {},
            distributed.ProcessGroup("arguments", "h:1", 2, 0),
        ),
        ({}, LAUNCH_ENV, distributed.ProcessGroup("environment", "127.0.0.1:5000", 2, 1)),
        (
            {},
            {**LAUNCH_ENV, distributed.CPU_DEVICES_ENV: "4"},
            distributed.ProcessGroup("environment", "127.0.0.1:5000", 2, 1, 4),
        ),
        ({"process_id": 0}, LAUNCH_ENV, distributed.ProcessGroup("arguments", "127.0.0.1:5000", 2, 0)),
        ({"num_processes": 1}, {}, distributed.ProcessGroup("arguments", None, 1, None)),
        ({"cpu_devices_per_process": 8}, {}, distributed.ProcessGroup("single", cpu_devices_per_process=8)),
        (
            {"cpu_devices_per_process": 2},
            LAUNCH_ENV,
            distributed.ProcessGroup("environment", "127.0.0.1:5000", 2, 1, 2),
        ),
        ({}, SLURM_STEP, distributed.ProcessGroup("cluster", cluster="SLURM")),
        ({}, {**SLURM_STEP, "SLURM_NTASKS": "1"}, distributed.ProcessGroup("single")),
        ({}, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, distributed.ProcessGroup("single")),  # sbatch, not srun
        (
            {},
            {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://h:1", "OMPI_COMM_WORLD_SIZE": "2"},
            distributed.ProcessGroup("cluster", cluster="Open MPI"),
        ),
        ({}, {"TPU_WORKER_HOSTNAMES": "w0,w1"}, distributed.ProcessGroup("cluster", cluster="TPU pod (GKE)")),
        ({}, {"TPU_WORKER_HOSTNAMES": "w0"}, distributed.ProcessGroup("single")),
        (
            {},
            {"TORCHSHARD_CLUSTER": "auto"},
            distributed.ProcessGroup("cluster", cluster="JAX auto-detection ($TORCHSHARD_CLUSTER=auto)"),
        ),
        (
            {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1},
            SLURM_STEP,
            distributed.ProcessGroup("arguments", "h:1", 2, 1),
        ),
    ],
)
def test_resolve(args, environ, expected):
    assert distributed.resolve(**args, environ=environ) == expected


@pytest.mark.parametrize(
    ("args", "environ", "match"),
    [
        ({"coordinator_address": "h:1"}, {}, r"missing num_processes=N \(or \$TORCHSHARD_NUM_PROCESSES\)"),
        ({"num_processes": 2}, {}, r"missing coordinator_address='host:port'"),
        ({"num_processes": 2, "process_id": 0}, {}, r"missing coordinator_address"),
        ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, {}, r"process_id=2 must be < num"),
        (
            {},
            {**LAUNCH_ENV, distributed.NUM_PROCESSES_ENV: "two"},
            r"1 problem\):\n  - num_processes='two' .* int ≥ 1$",
        ),
        ({"coordinator_address": "h:1", "num_processes": 2, "process_id": -1}, {}, r"process_id=-1 .* int ≥ 0"),
        ({"cpu_devices_per_process": 0}, {}, r"cpu_devices_per_process=0 .* must be an int ≥ 1"),
        ({}, {distributed.CPU_DEVICES_ENV: "x"}, r"cpu_devices_per_process='x'"),
    ],
)
def test_resolve_errors(args, environ, match):
    with pytest.raises(ShardingError, match=match):
        distributed.resolve(**args, environ=environ)


# --- initialize(): what it calls ------------------------------------------------------------------


@pytest.fixture
def fake_jax(monkeypatch):
    """Records jax.distributed.initialize and runtime configuration calls; JAX itself is untouched."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(_distributed, "_current", None)
    monkeypatch.setattr(_distributed, "backend_started", lambda: False)
    monkeypatch.setattr(_distributed, "_configure_runtime", lambda cpus: calls.append(("configure", cpus)))
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a: calls.append(("initialize", *a)))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: any(c[0] == "initialize" for c in calls))
    return calls


def test_initialize_after_jax_distributed_initialize(fake_jax, monkeypatch):
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(_distributed, "backend_started", lambda: True)
    assert distributed.initialize("h:1", 2, 0).source == "arguments"
    assert fake_jax == [("configure", None)]


@pytest.mark.parametrize(
    ("args", "environ", "expected"),
    [
        ({}, {}, [("configure", None)]),
        ({"cpu_devices_per_process": 8}, {}, [("configure", 8)]),
        (
            {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1, "cpu_devices_per_process": 4},
            {},
            [("configure", 4), ("initialize", "h:1", 2, 1)],
        ),
        ({}, LAUNCH_ENV, [("configure", None), ("initialize", "127.0.0.1:5000", 2, 1)]),
        ({}, SLURM_STEP, [("configure", None), ("initialize",)]),
    ],
)
def test_initialize_calls(fake_jax, monkeypatch, args, environ, expected):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    group = distributed.initialize(**args)
    assert fake_jax == expected
    assert distributed.initialize(**args) is group  # the same setup again is a no-op
    assert fake_jax == expected


def test_initialize_twice_differently(fake_jax):
    distributed.initialize("h:1", 2, 0)
    with pytest.raises(ShardingError, match=r"already called with .* cannot change"):
        distributed.initialize("h:1", 2, 1)


def test_initialize_after_backend_started(fake_jax, monkeypatch):
    monkeypatch.setattr(_distributed, "backend_started", lambda: True)
    with pytest.raises(ShardingError, match=r"after JAX started its backend; call it first thing"):
        distributed.initialize("h:1", 2, 0)
    assert fake_jax == []


def test_process_helpers_single_process():
    assert (distributed.process_index(), distributed.process_count(), distributed.is_main_process()) == (0, 1, True)


# --- process-local batches (single process: local == global) -------------------------------------


@pytest.mark.parametrize(
    ("local_shape", "spec", "expected"),
    [((16, 3), ("data",), (16, 3)), ((8, 6), ("data", "model"), (8, 6)), ((5,), (), (5,))],
)
def test_global_shape_single_process(mesh_dm, local_shape, spec, expected):
    assert distributed.global_shape(local_shape, NamedSharding(mesh_dm, PartitionSpec(*spec))) == (expected, [])


def test_global_shape_problem(mesh_dm):
    _, problems = distributed.global_shape((6, 3), NamedSharding(mesh_dm, PartitionSpec("data")), what="x")
    assert problems == [
        "x (6, 3): dim 0 (size 6) does not split over the 4 shards this process holds on Mesh(data=4, model=2); "
        "give each process a multiple of 4"
    ]


@pytest.mark.parametrize(("spec", "expected"), [(("data",), slice(0, 16)), ((("data", "model"),), slice(0, 16))])
def test_local_batch_slice_single_process(mesh_dm, spec, expected):
    assert distributed.local_batch_slice(16, mesh_dm, spec) == expected


def test_local_batch_slice_indivisible(mesh_fsdp):
    with pytest.raises(ShardingError, match=r"batch size 12 does not split over the 8 batch shards .* multiple of 8"):
        distributed.local_batch_slice(12, mesh_fsdp)


def test_trainer_local_batch_errors(mesh_fsdp):
    import optax

    model = torch.nn.Linear(4, 2)
    trainer = torchshard.Trainer(model, lambda m, b: m(b).sum(), optax.sgd(0.1), torchshard.plan(model, mesh_fsdp))
    with pytest.raises(ShardingError, match=r"process-local batch leaf #0 \(6, 4\): dim 0 .* multiple of 8"):
        trainer.step(torch.ones(6, 4), local=True)


# --- the launcher, with cheap children (no JAX) ---------------------------------------------------


def _python(code: str, nproc: int = 2) -> tuple[list[str], list[dict[str, str]]]:
    envs = [launch.child_env(rank, nproc, 1, None, dict(os.environ)) for rank in range(nproc)]
    return [
        sys.executable,
        "-c",
        f"import os, signal, sys, time\nrank = int(os.environ['{distributed.PROCESS_ID_ENV}'])\n{code}",
    ], envs


SEND_SIGTERM = "rank == 0 and os.kill(os.getppid(), signal.SIGTERM)\ntime.sleep(60)"
CHILDREN = {
    "ok": "print(f'hello {rank}')",
    "rank1_fails": "sys.exit(3) if rank == 1 else time.sleep(60)",
    "sleep": "time.sleep(60)",
    # rank 0 sends SIGTERM to the launcher (the test process), which must forward it
    "sigterm": SEND_SIGTERM,
    # like a process inside jax.distributed, whose preemption notifier catches SIGTERM
    "sigterm_ignored": "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SEND_SIGTERM,
    # a preempted process that saves and exits cleanly: the run exits 0
    "sigterm_handled": "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\ntime.sleep(1)\n" + SEND_SIGTERM,
}


@pytest.mark.parametrize(
    ("child", "timeout", "code", "max_s"),
    [
        ("ok", None, 0, 10),
        ("rank1_fails", None, 3, 10),
        ("sleep", 0.5, launch.TIMEOUT_EXIT, 10),
        ("sigterm", None, 128 + signal.SIGTERM, 10),
        ("sigterm_ignored", None, 128 + signal.SIGTERM, 15),
        ("sigterm_handled", None, 0, 10),
    ],
)
@pytest.mark.slow
def test_run_processes(child, timeout, code, max_s):
    command, envs = _python(CHILDREN[child])
    out = io.StringIO()
    start = time.monotonic()
    assert launch.run_processes(command, envs, timeout=timeout, term_grace=3.0, out=out) == code, out.getvalue()
    assert time.monotonic() - start < max_s
    if child == "ok":
        assert sorted(out.getvalue().splitlines()) == ["[rank 0] hello 0", "[rank 1] hello 1"]


# --- the hang watchdog: no output and no heartbeat from any process for S seconds -------------------

DUMPS_STACKS = "import faulthandler\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"  # as the worker does
HANGS = {
    "sleep": DUMPS_STACKS + "def stuck_here():\n    time.sleep(60)\nstuck_here()",
    "deadlock": DUMPS_STACKS
    + "lock = threading.Lock()\nlock.acquire()\ndef stuck_here():\n    lock.acquire()\nstuck_here()",
    "one_rank_sleeps": DUMPS_STACKS + "def stuck_here():\n    time.sleep(60)\nstuck_here() if rank == 1 else None",
}


@pytest.mark.slow
@pytest.mark.parametrize("child", HANGS)
def test_a_hang_prints_every_stack_and_ends_the_run_naming_the_stalled_ranks(child, capsys):
    command, envs = _python("import threading\n" + HANGS[child])
    out = io.StringIO()
    start = time.monotonic()
    assert launch.run_processes(command, envs, hang_timeout=1.0, out=out) == launch.HANG_EXIT, out.getvalue()
    assert time.monotonic() - start < 15
    stalled = [1] if child == "one_rank_sleeps" else [0, 1]  # rank 0 of that one exits 0 at once
    for rank in stalled:
        assert re.search(rf"\[rank {rank}\]   File \"<string>\", line \d+ in stuck_here", out.getvalue()), (
            out.getvalue()
        )
    note = capsys.readouterr().err
    ranks = ", ".join(map(str, stalled))
    assert f"no process made progress (printed output or heartbeat) for 1 s; ranks {ranks} are stalled" in note
    assert f"stopping every process: ranks {ranks} hung (raise --hang-timeout if they were only slow)" in note


LOOP = "for i in range(10):\n    time.sleep(0.25)\n    "
WORKER_FILE = ROOT / "torchshard" / "_multihost" / "worker.py"
IMPORT_WORKER = (  # the module alone: importing torchshard (JAX, torch) would take longer than the timeout
    "import importlib.util\n"
    f"spec = importlib.util.spec_from_file_location('worker', {str(WORKER_FILE)!r})\n"
    "worker = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(worker)\n"
)
PROGRESS = {
    "output_from_one_rank": LOOP + "print(i, flush=True) if rank == 0 else None",
    "heartbeats_only": LOOP + "os.utime(os.environ['TORCHSHARD_HEARTBEAT'])",
    "heartbeat_function": IMPORT_WORKER + LOOP + "worker.heartbeat()",
    # rank 1 gets a full timeout after rank 0 ends: it outlives one timeout from the start (1.4 > 1.0) but not one
    # from rank 0's end (1.4 < 0.8 + 1.0), with 0.4 s to spare either way for a loaded machine's scheduling
    "one_rank_ends_early": "time.sleep(0.8 if rank == 0 else 1.4)",
}


@pytest.mark.parametrize("child", PROGRESS)
@pytest.mark.slow
def test_output_or_heartbeats_are_progress(child):
    command, envs = _python(PROGRESS[child])
    out = io.StringIO()
    assert launch.run_processes(command, envs, hang_timeout=1.0, out=out) == 0, out.getvalue()


def test_heartbeat_touches_the_launchers_file_at_most_twice_a_second(tmp_path, monkeypatch):
    beat = tmp_path / "beat"
    beat.touch()
    os.utime(beat, (0, 0))
    _worker.heartbeat()  # outside a launched run: nothing happens
    assert beat.stat().st_mtime == 0
    monkeypatch.setenv(_worker.HEARTBEAT_ENV, str(beat))
    monkeypatch.setattr(_worker, "_last_beat", 0.0)
    _worker.heartbeat()
    assert beat.stat().st_mtime > time.time() - 60
    os.utime(beat, (0, 0))
    _worker.heartbeat()  # within half a second of the last beat: skipped
    assert beat.stat().st_mtime == 0


@pytest.mark.parametrize(
    ("argv", "expected"), [([], 600.0), (["--hang-timeout", "2.5"], 2.5), (["--hang-timeout", "0"], 0)]
)
def test_launcher_hang_timeout_option(argv, expected):
    assert launch.parse_args(["--nproc", "2", *argv, "x.py"]).hang_timeout == expected


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_launcher_rejects_a_bad_hang_timeout(value, capsys):
    with pytest.raises(SystemExit, match="2"):
        launch.parse_args(["--nproc", "2", "--hang-timeout", value, "x.py"])
    assert "--hang-timeout" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cpu_devices", "expected"),
    [
        (
            None,
            {"TORCHSHARD_COORDINATOR": "127.0.0.1:99", "TORCHSHARD_NUM_PROCESSES": "2", "TORCHSHARD_PROCESS_ID": "1"},
        ),
        (4, {"TORCHSHARD_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu"}),
    ],
)
def test_child_env(cpu_devices, expected):
    env = launch.child_env(1, 2, 99, cpu_devices, {"KEEP": "1"})
    assert env["KEEP"] == "1" and env.items() >= expected.items()
    assert ("TORCHSHARD_CPU_DEVICES" in env) == (cpu_devices is not None)


@pytest.mark.parametrize("argv", [["--nproc", "0", "x.py"], ["--nproc", "two", "x.py"], ["x.py"]])
def test_launcher_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit, match="2"):
        launch.parse_args(argv)


def test_launcher_missing_script(capsys):
    assert launch.main(["--nproc", "2", "no_such_script.py"]) == 2
    assert "no such script: no_such_script.py" in capsys.readouterr().err


# --- real multi-process runs (loopback, bounded by subprocess timeouts) ---------------------------


def _launch(
    nproc: int, cpus: int, script: str, *args: str, timeout: float
) -> tuple[subprocess.CompletedProcess, float]:
    command = [sys.executable, "-m", "torchshard.launch", "--nproc", str(nproc), "--cpu-devices-per-proc", str(cpus)]
    command += ["--timeout", str(timeout), str(TESTS / script), *args]
    start = time.monotonic()
    # the scripts, run by path, import testsupport from the clone
    result = subprocess.run(command, cwd=ROOT, env=root_env(), capture_output=True, text=True, timeout=timeout + 30)
    return result, time.monotonic() - start


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """The training script as 1 process × 8 devices (this one: a launch would spend its time importing torch and
    JAX) and as 2 processes × 4 devices under the launcher: each rank's JSON."""
    one, two = tmp_path_factory.mktemp("run1x8"), tmp_path_factory.mktemp("run2x4")
    spec = importlib.util.spec_from_file_location("mp_train_script", TESTS / "mp_train_script.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # its initialize() is single-process here, as in any test
    script.main(str(one))
    result, _ = _launch(2, 4, "mp_train_script.py", str(two), timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return {"1x8": [json.loads((one / "rank0.json").read_text())],
            "2x4": [json.loads((two / f"rank{r}.json").read_text()) for r in range(2)]}  # fmt: skip


@pytest.mark.slow
def test_every_process_sees_the_same_run(runs):
    rank0, rank1 = runs["2x4"]
    assert (rank0["process_count"], rank0["devices"], runs["1x8"][0]["devices"]) == (2, 8, 8)
    without_rows = [{k: {**v, "rows": None} for k, v in r["results"].items()} for r in (rank0, rank1)]
    assert without_rows[0] == without_rows[1]
    assert [rank0["results"]["tp"]["rows"], rank1["results"]["tp"]["rows"]] == [[0, 8], [8, 16]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp", "tp", "fsdp", "init_sharded"])
def test_two_processes_match_one(runs, name):
    one, two = runs["1x8"][0]["results"][name], runs["2x4"][0]["results"][name]
    assert_close(two["losses"], one["losses"], tol=1e-5, what=f"{name} losses")
    assert_close(two["evaluated"], one["evaluated"], tol=1e-5, what=f"{name} evaluate(batch) and (local=True)")
    assert len(set(one["evaluated"])) <= 1  # the global batch and the processes' own rows give one loss
    assert_trees_close(two["params"], one["params"], tol=1e-5)


@pytest.mark.slow
def test_failing_process_ends_the_run():
    result, seconds = _launch(2, 1, "mp_control_script.py", "crash", timeout=90)
    assert result.returncode == 1, result.stdout[-4000:]
    assert "[rank 1] RuntimeError: rank 1 fails on purpose" in result.stdout
    assert "rank 1 exited with code 1; stopping the others" in result.stderr
    assert seconds < 60  # rank 0 would sleep 120 s


@pytest.mark.slow
def test_processes_end_when_the_launcher_is_killed():
    command = [
        sys.executable,
        "-m",
        "torchshard.launch",
        "--nproc",
        "2",
        "--cpu-devices-per-proc",
        "1",
        "--timeout",
        "90",
    ]
    launcher = subprocess.Popen(
        [*command, str(TESTS / "mp_control_script.py"), "sleep"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(line.split()[-1]) for line in _lines_with(launcher.stdout, "ready", count=2, within_s=60)]
    finally:
        launcher.kill()  # SIGKILL: no chance to stop its children itself
        launcher.communicate()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _lines_with(stream, word: str, *, count: int, within_s: float) -> list[str]:
    found, deadline = [], time.monotonic() + within_s
    while len(found) < count and time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        found += [line] if word in line else []
    assert len(found) == count, found
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_hung_run_prints_each_workers_stack_and_stops():
    command = [sys.executable, "-m", "torchshard.launch", "--nproc", "2", "--cpu-devices-per-proc", "1"]
    command += ["--hang-timeout", "3", "--timeout", "120", str(TESTS / "mp_hang_script.py")]
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert result.returncode == launch.HANG_EXIT, result.stdout[-4000:] + result.stderr[-4000:]
    assert time.monotonic() - start < 120
    assert re.search(r"\[rank 0\]   File .*mp_hang_script\.py\", line \d+ in sleep_forever", result.stdout), (
        result.stdout
    )
    assert re.search(r"\[rank 1\]   File .*mp_hang_script\.py\", line \d+ in deadlock", result.stdout), result.stdout
    assert "for 3 s; ranks 0, 1 are stalled" in result.stderr


@pytest.mark.slow
def test_a_save_that_fails_on_one_process_ends_on_every_process(tmp_path):
    """Without agreeing on failures, the other process would wait at the save's barrier until the hang timeout.

    One launch runs three cases in turn (see the script): ``failing=2`` names no process, and the save succeeds (one
    device per process: the Trainer's replicated RNG key was once an array whose shards could not be listed, and
    every such save failed); then process 0's saves fail, then process 1's.
    """
    command = [sys.executable, "-m", "torchshard.launch", "--nproc", "2", "--cpu-devices-per-proc", "1"]
    command += ["--hang-timeout", "60", str(TESTS / "mp_save_script.py"), str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for failing, rank in ((f, r) for f in (2, 0, 1) for r in (0, 1)):
        prefix = f"[rank {rank}] failing={failing} "
        said = [line.removeprefix(prefix) for line in result.stdout.splitlines() if line.startswith(prefix)]
        lines = {line.split(":")[0]: line for line in said if line.split(":")[0] in ("save", "export", "after")}
        assert list(lines) == ["save", "export", "after"], (failing, rank, said)
        if failing == 2:
            assert (lines["save"], lines["export"]) == ("save: saved", "export: saved"), said
            continue
        assert lines["save"].startswith("save: CheckpointError: "), said
        if failing == 0:  # process 1 has nothing to do before the first barrier: it learns of process 0's failure there
            expected = "No space left on device" if rank == 0 else "process(es) [0] failed"
            assert expected in lines["save"], said
        # only process 0 writes an export's files
        assert lines["export"].startswith("export: CheckpointError: " if failing == 0 else "export: saved"), said
        assert lines["after"].startswith("after: loss "), said


@pytest.mark.slow
def test_a_preempted_run_saves_at_one_agreed_step_exits_0_and_resumes_with_the_uninterrupted_losses(tmp_path):
    """Process 1 sends SIGTERM to the launcher mid-run; every process stops at the same step, saves, exits 0."""
    for mode in ("preempt", "resume"):  # the resuming launch then runs the uninterrupted one ("full")
        result, _ = _launch(2, 2, "mp_preempt_script.py", str(tmp_path), mode, timeout=150)
        assert result.returncode == 0, (mode, result.stdout[-4000:] + result.stderr[-4000:])
    modes = ("full", "preempt", "resume")
    runs = {m: [json.loads((tmp_path / f"{m}.rank{r}.json").read_text()) for r in (0, 1)] for m in modes}
    (agreed,) = {r["preempted_at"] for r in runs["preempt"]}  # one step, the same on both processes
    assert agreed is not None and 4 <= agreed < 40, agreed
    assert torchshard.checkpoint_steps(tmp_path / "ckpt") == [agreed]
    for rank in (0, 1):
        joined = {**runs["preempt"][rank]["losses"], **runs["resume"][rank]["losses"]}
        full = runs["full"][rank]["losses"]
        assert list(joined) == list(full)
        np.testing.assert_allclose(list(joined.values()), list(full.values()), rtol=1e-5)


@pytest.mark.slow
def test_each_processs_data_loader_resumes_with_the_batches_and_losses_of_an_uninterrupted_run(tmp_path):
    """2 processes × 4 devices, each a StatefulDataLoader over its own rows; stopped mid-epoch, resumed anew."""
    modes = ("full", "first", "resume")
    for mode in ("first", "resume"):  # the resuming launch then runs the uninterrupted one ("full")
        result, _ = _launch(2, 4, "mp_data_script.py", str(tmp_path), mode, timeout=150)
        assert result.returncode == 0, (mode, result.stdout[-4000:] + result.stderr[-4000:])
    runs = {m: [json.loads((tmp_path / f"{m}.rank{r}.json").read_text()) for r in (0, 1)] for m in modes}
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step_00000004" / "data").iterdir()) == [
        "process_0.json",
        "process_1.json",
    ]
    for rank in (0, 1):
        full, first, resume = (runs[m][rank] for m in modes)
        assert list(first["seen"]) == ["0", "1", "2", "3"] and list(resume["seen"]) == ["4", "5", "6", "7"]
        assert {**first["seen"], **resume["seen"]} == full["seen"]  # the same rows, in the same order
        assert {**first["losses"], **resume["losses"]} == full["losses"]  # the same program on the same inputs
    rows = [{i for ids in runs["full"][rank]["seen"].values() for i in ids} for rank in (0, 1)]
    assert rows == [set(range(12)), set(range(12, 24))]  # each process its own rows
