"""torchrun as the launcher: its environment parsed, the coordinator agreed through its store, real torchrun runs.

The slow tests start real ``torchrun`` processes (2 processes × 2 CPU devices, a tiny MLP, 8 AdamW
steps): ``--standalone`` with a worker killed mid-run and ``--max-restarts 1``, two ``--nnodes 2``
invocations, and a SIGTERM to the agent (preemption) followed by a resume. Every run's losses are
compared with eager torch's AdamW on the same batches, and the interrupted runs' with the uninterrupted one's.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import torch

from testsupport.helpers import assert_close, torch_losses
from torchshard import ArgumentError, ShardingError, distributed
from torchshard._multihost import runtime as _runtime
from torchshard._multihost import torchrun as _torchrun

TESTS = Path(__file__).parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
TWO_NODES = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n0",
             "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
PG = distributed.ProcessGroup
SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[0-1]", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}


# --- the environment -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (TWO_NODES, distributed.ProcessGroup("torchrun", None, 4, 3, local_device_ids=(1,))),
        ({**TWO_NODES, distributed.CPU_DEVICES_ENV: "2"}, distributed.ProcessGroup("torchrun", None, 4, 3, 2)),
        # srun torchrun: torchrun's RANK wins over SLURM's SLURM_PROCID
        ({**SLURM, **TWO_NODES}, distributed.ProcessGroup("torchrun", None, 4, 3, local_device_ids=(1,))),
        ({"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "r"}, PG("torchrun", None, 1, 0)),
        # Kubeflow's PyTorchJob: torch's variables without torchrun's agent
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9"}, PG("torchrun", None, 2, 1)),
        (  # torchshard's own variables win over torchrun's
            {
                **TWO_NODES,
                distributed.COORDINATOR_ENV: "h:1",
                distributed.NUM_PROCESSES_ENV: "2",
                distributed.PROCESS_ID_ENV: "0",
            },
            distributed.ProcessGroup("environment", "h:1", 2, 0),
        ),
        ({"RANK": "0"}, distributed.ProcessGroup("single")),  # a stray RANK alone is no torchrun
    ],
)
def test_resolve_torchrun(environ, expected):
    assert distributed.resolve(environ=environ) == expected


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"RANK": "4"}, r"\$RANK=4 must be in \[0, \$WORLD_SIZE=4\)"),
        ({"WORLD_SIZE": "four"}, r"\$WORLD_SIZE='four' is not an integer"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, r"\$WORLD_SIZE=0 must be ≥ 1"),
        ({"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0"}, r"\$LOCAL_WORLD_SIZE=3 does not divide \$WORLD_SIZE=4"),
        ({"LOCAL_RANK": "0"}, r"\$LOCAL_RANK=0 does not fit \$RANK=3 .* \(expected 1\)"),
        ({"LOCAL_RANK": "2"}, r"\$LOCAL_RANK=2 must be in \[0, \$LOCAL_WORLD_SIZE=2\)"),
        ({"MASTER_PORT": "70000"}, r"\$MASTER_PORT=70000 must be a TCP port"),
        ({"MASTER_ADDR": None}, r"\$MASTER_ADDR is not set; start the script with torchrun"),
        ({"RANK": "x", "WORLD_SIZE": "y"}, r"\(2 problems\):\n  - \$RANK='x' .*\n  - \$WORLD_SIZE='y'"),
    ],
)
def test_inconsistent_torchrun_environment(change, match):
    environ = {k: v for k, v in {**TWO_NODES, **change}.items() if v is not None}
    with pytest.raises(ArgumentError, match=match):
        distributed.resolve(environ=environ)


@pytest.mark.parametrize(
    ("environ", "error", "match"),
    [
        # torch's variables of a multi-process run, without what joins it: not a single process in disguise
        ({"RANK": "1", "WORLD_SIZE": "2"}, ArgumentError, r"\$MASTER_ADDR is not set; start the script with torchrun"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, ArgumentError, r"\$MASTER_ADDR is not set"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, ArgumentError, r"\(2 problems\):\n  - \$MASTER_ADDR .*\n  - \$MASTER_PORT"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, ArgumentError, r"\$RANK=3 must be in \[0, \$WORLD_SIZE=2\)"),
        ({"RANK": "1", "WORLD_SIZE": "1"}, ArgumentError, r"\$RANK=1 must be in \[0, \$WORLD_SIZE=1\)"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, ArgumentError, r"\$WORLD_SIZE='two' is not an integer"),
        ({distributed.CPU_DEVICES_ENV: "abc"}, ShardingError, r"cpu_devices_per_process='abc' \(argument or "
                                                              r"\$TORCHSHARD_CPU_DEVICES\) must be an int ≥ 1"),
        ({distributed.NUM_PROCESSES_ENV: "2", "RANK": "0", "WORLD_SIZE": "2"}, ShardingError,
         r"missing coordinator_address='host:port' \(or \$TORCHSHARD_COORDINATOR\)"),  # torchshard's win, half set
    ],
    ids=["rank1_of_2", "no_master_addr", "rank0_of_2", "rank_past_world", "rank1_of_1", "world_not_int",
         "cpu_devices_not_int", "torchshard_half_set"],
)  # fmt: skip
def test_variables_that_contradict_each_other_are_refused_by_initialize(environ, error, match, monkeypatch):
    with pytest.raises(error, match=match):
        distributed.resolve(environ=environ)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", *_torchrun_variables()):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(error, match=match):  # before anything touches JAX
        distributed.initialize()


def _torchrun_variables() -> list[str]:
    return [k for k in os.environ if k.startswith(("TORCHSHARD_", "TORCHELASTIC_", "SLURM_", "OMPI_"))]


@pytest.mark.parametrize("environ", [{"RANK": "0", "WORLD_SIZE": "1"}, {"RANK": "0"}, {"WORLD_SIZE": "1"}, {}])
def test_one_process_as_torchs_variables_describe_it_runs_alone(environ):
    assert distributed.resolve(environ=environ) == distributed.ProcessGroup("single")


def test_is_torchrun():
    assert _torchrun.is_torchrun({"TORCHELASTIC_RUN_ID": "r"})
    assert not _torchrun.is_torchrun({"RANK": "0", "WORLD_SIZE": "2"})


# --- the coordinator: one port agreed through torchrun's store -----------------------------------


@pytest.fixture
def store_env():
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=20))  # fmt: skip
    env = {**TWO_NODES, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    yield env, store


def _env(environ, rank):
    local = int(environ["LOCAL_WORLD_SIZE"])
    return _torchrun.parse({**environ, "RANK": str(rank), "LOCAL_RANK": str(rank % local)})


def test_process_0_publishes_a_free_port_once_and_every_restart_reuses_it(store_env):
    environ, store = store_env
    first = _torchrun.coordinator_address(_env(environ, 0))
    host, port = first.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) != int(environ["MASTER_PORT"])
    assert [_torchrun.coordinator_address(_env(environ, r)) for r in (3, 0)] == [first, first]
    assert store.get(_torchrun.PORT_KEY).decode() == port


def test_an_unreachable_store_is_named(monkeypatch):
    monkeypatch.setattr(_torchrun, "STORE_TIMEOUT_S", 0.2)
    env = _torchrun.parse({**TWO_NODES, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    with pytest.raises(ShardingError, match=r"process 3 cannot agree .* store at \$MASTER_ADDR:\$MASTER_PORT = 127"):
        _torchrun.coordinator_address(env)


def test_without_an_agent_store_the_port_is_master_port_plus_one():
    env = _torchrun.parse({**TWO_NODES, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert _torchrun.coordinator_address(env) == "n0:29501"


def test_initialize_joins_at_the_agreed_coordinator(store_env, monkeypatch):
    environ, _ = store_env
    calls = []
    monkeypatch.setattr(os, "environ", {**environ, "RANK": "1", "LOCAL_RANK": "1"})
    monkeypatch.setattr(_runtime, "_current", None)
    monkeypatch.setattr(_runtime, "backend_started", lambda: False)
    monkeypatch.setattr(_runtime, "_configure_runtime", lambda cpus: calls.append(("configure", cpus)))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: len(calls) > 1)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((*a, k)))
    _torchrun.coordinator_address(_env(environ, 0))  # process 0 published its port
    group = distributed.initialize()
    assert calls[1] == (group.coordinator_address, 4, 1, {"local_device_ids": (1,)})
    assert group.coordinator_address.startswith("127.0.0.1:") and distributed.initialize() == group


# --- real torchrun processes ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(root: Path, mode: str, *flags: str, wait: bool = True, slurm: dict[str, str] | None = None):
    env = {**os.environ, "TORCHSHARD_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(TESTS.parent), **(slurm or {})}  # fmt: skip
    command = [str(TORCHRUN), *flags, str(TESTS / "mp_torchrun_script.py"), str(root), mode]
    popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return popen
    out, _ = popen.communicate(timeout=400)
    return out, popen.returncode


def _results(root: Path, mode: str, started: int) -> list[dict]:
    return [json.loads((root / f"{mode}.from{started}.rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def eager_losses() -> list[float]:
    """The script's training in eager torch: its model and batches, torch's AdamW with optax's defaults."""
    spec = importlib.util.spec_from_file_location("mp_torchrun_script", TESTS / "mp_torchrun_script.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # its initialize() is single-process here, as in any test
    model = script.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=1e-4)
    return torch_losses(model, script.loss_fn, opt, [script.batch(s) for s in range(script.STEPS)])


def _losses(result: dict) -> list[float]:
    return [result["losses"][str(s)] for s in range(result["started"], result["stopped"])]


def _srun_task(node: int, *, nodes: int) -> dict[str, str]:
    """The variables srun sets for the task on ``node`` of a step with one task per node."""
    return {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NNODES": str(nodes), "SLURM_NODEID": str(node),
            "SLURM_NTASKS": str(nodes), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0",
            "SLURM_STEP_NODELIST": f"n[0-{nodes - 1}]", "SLURM_JOB_NODELIST": f"n[0-{nodes - 1}]",
            "SLURM_STEP_NUM_TASKS": str(nodes), "SLURM_CPUS_ON_NODE": "2"}  # fmt: skip


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> list[dict]:
    """Two torchrun invocations of one process each (node ranks 0 and 1) meeting at one rendezvous endpoint.

    Each runs in the environment ``srun --nodes 2 --ntasks-per-node 1 torchrun ...`` gives its task
    (there is no SLURM here): JAX's own cluster detection would take the SLURM step, so the results'
    ``source`` being "torchrun" shows torchrun's variables win, as the docs' SLURM recipe needs.
    """
    root, port = tmp_path_factory.mktemp("nodes"), _free_port()
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [
        _run(root, "train", *flags, "--node-rank", str(i), wait=False, slurm=_srun_task(i, nodes=2)) for i in range(2)
    ]
    for node in nodes:
        out, _ = node.communicate(timeout=400)
        assert node.returncode == 0, out[-4000:]
    return _results(root, "train", 0)


@pytest.mark.slow
def test_two_nodes_train_as_eager_torch(two_nodes, eager_losses):
    assert [(r["source"], r["processes"], r["devices"], r["local_devices"]) for r in two_nodes] == [
        ("torchrun", 2, 4, 2)
    ] * 2
    for result in two_nodes:
        assert_close(_losses(result), eager_losses, tol=1e-4, what="torchrun --nnodes 2 losses")


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_resumes_from_the_last_checkpoint(tmp_path, two_nodes, eager_losses):
    out, code = _run(tmp_path, "crash", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1")
    assert code == 0, out[-4000:]
    # the kill happened and torchrun restarted the group; which failure it saw first is a race: the kill (-9) or
    # process 0's exit when its next collective lost the peer (1)
    assert (tmp_path / "crash.done-once").exists() and re.search(r"failed \(exitcode: (-9|1)\)", out), out[-4000:]
    # process 0 ended on its own (failfast.py): torchrun did not wait 30 s on it and then SIGKILL it
    assert "forcefully exiting via 9" not in out, out[-4000:]
    resumed = _results(tmp_path, "crash", 4)
    assert [(r["attempt"], r["stopped"]) for r in resumed] == [("1", 8)] * 2
    for result in resumed:  # exactly the uninterrupted run's losses (same mesh), and eager torch's
        assert _losses(result) == _losses(two_nodes[0])[4:]
        assert_close(_losses(result), eager_losses[4:], tol=1e-4, what="resumed losses")


@pytest.mark.slow
def test_sigterm_through_torchrun_is_a_preemption_then_a_resume(tmp_path, two_nodes):
    out, code = _run(tmp_path, "preempt", "--standalone", "--nproc-per-node", "2")
    assert code != 0 and "got signal: 15" in out, out[-4000:]  # the agent itself ends on the signal
    stopped = _results(tmp_path, "preempt", 0)
    at = {r["stopped"] for r in stopped}  # every process agreed on one step (the signal's timing says which)
    assert len(at) == 1 and 4 <= min(at) < 8, at
    out, code = _run(tmp_path, "preempt", "--standalone", "--nproc-per-node", "2")
    assert code == 0, out[-4000:]
    for first, rest in zip(stopped, _results(tmp_path, "preempt", min(at)), strict=True):
        assert _losses(first) + _losses(rest) == _losses(two_nodes[0])
