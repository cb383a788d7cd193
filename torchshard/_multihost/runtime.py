"""Multi-process (multi-host) runs on JAX's multi-controller runtime: one call before anything else."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

import jax

from torchshard._base.errors import ShardingError, raise_if_any
from torchshard._bridge.env import backend_started
from torchshard._multihost import failfast, torchrun
from torchshard._sharding.mesh import use_cpu_devices

logger = logging.getLogger(__name__)

COORDINATOR_ENV = "TORCHSHARD_COORDINATOR"
NUM_PROCESSES_ENV = "TORCHSHARD_NUM_PROCESSES"
PROCESS_ID_ENV = "TORCHSHARD_PROCESS_ID"
CPU_DEVICES_ENV = "TORCHSHARD_CPU_DEVICES"
CLUSTER_ENV = "TORCHSHARD_CLUSTER"  # "auto": always defer to JAX's detection (GCE TPU VMs, Kubernetes...)

Source = Literal["arguments", "environment", "torchrun", "cluster", "single"]


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """How this process was set up; ``None`` fields are left for JAX's cluster detection to fill."""

    source: Source
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    cpu_devices_per_process: int | None = None
    cluster: str | None = None
    local_device_ids: tuple[int, ...] | None = None


def _count(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ.get(name, "1"))
    except ValueError:
        return 1


def _hosts(environ: Mapping[str, str], name: str) -> int:
    return len([h for h in environ.get(name, "").split(",") if h.strip()])


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
    """Names the multi-process cluster this process runs in (SLURM, Open MPI, TPU pod), if any.

    Other clusters JAX knows (Cloud TPU VMs on GCE, Kubernetes, mpi4py) need a metadata query
    or a package to be recognised; set ``TORCHSHARD_CLUSTER=auto`` to defer to JAX there.

    Args:
        environ: environment to inspect; defaults to ``os.environ``.

    Returns:
        The cluster's name, or ``None`` for a plain single process.

    Examples:
        >>> detect_cluster({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:5000", "OMPI_COMM_WORLD_SIZE": "4"})
        'Open MPI'
    """
    # the variables JAX's own detection reads; a cluster counts only when it runs several
    # processes, so a plain `python` in an sbatch script or `mpirun -n 1` stays a no-op
    environ = os.environ if environ is None else environ
    if environ.get(CLUSTER_ENV) == "auto":
        return f"JAX auto-detection (${CLUSTER_ENV}=auto)"
    slurm_step = all(k in environ for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID"))
    if slurm_step and _count(environ, "SLURM_NTASKS") > 1:
        return "SLURM"
    if "OMPI_MCA_orte_hnp_uri" in environ and _count(environ, "OMPI_COMM_WORLD_SIZE") > 1:
        return "Open MPI"
    if _hosts(environ, "TPU_WORKER_HOSTNAMES") > 1:
        return "TPU pod (GKE)"
    return None


def _int_field(name: str, value: int | str | None, env_name: str, *, minimum: int) -> tuple[int | None, list[str]]:
    if value is None:
        return None, []
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or number < minimum:
        return None, [f"{name}={value!r} (argument or ${env_name}) must be an int ≥ {minimum}"]
    return number, []


_ENV_NAMES = {
    "coordinator_address": COORDINATOR_ENV,
    "num_processes": NUM_PROCESSES_ENV,
    "process_id": PROCESS_ID_ENV,
    "cpu_devices_per_process": CPU_DEVICES_ENV,
}
_CORE = ("coordinator_address", "num_processes", "process_id")


def _merge(explicit: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    return {k: explicit[k] if explicit[k] is not None else environ.get(env) for k, env in _ENV_NAMES.items()}


def _validate(merged: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    num, problems = _int_field("num_processes", merged["num_processes"], NUM_PROCESSES_ENV, minimum=1)
    pid, more = _int_field("process_id", merged["process_id"], PROCESS_ID_ENV, minimum=0)
    cpus, most = _int_field("cpu_devices_per_process", merged["cpu_devices_per_process"], CPU_DEVICES_ENV, minimum=1)
    problems += more + most
    if num is not None and pid is not None and pid >= num:
        problems.append(f"process_id={pid} must be < num_processes={num}")
    return {**merged, "num_processes": num, "process_id": pid, "cpu_devices_per_process": cpus}, problems


def _missing(merged: dict[str, Any]) -> list[str]:
    if str(merged["num_processes"]) == "1" and merged["coordinator_address"] is None:
        return []  # one process needs no coordinator
    hints = {
        "coordinator_address": f"coordinator_address='host:port' (or ${COORDINATOR_ENV})",
        "num_processes": f"num_processes=N (or ${NUM_PROCESSES_ENV})",
        "process_id": f"process_id=i (or ${PROCESS_ID_ENV})",
    }
    return [f"missing {hint}" for key, hint in hints.items() if merged[key] is None]


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices_per_process: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ProcessGroup:
    """Decides how `initialize` sets this process up, without touching JAX.

    Each field comes from its argument, else from its ``TORCHSHARD_*`` variable (set by
    ``python -m torchshard.launch``); with none of them, torchrun's variables (``RANK``,
    ``WORLD_SIZE``...: the coordinator is agreed on when joining); else a detected cluster defers
    to JAX's own auto-detection; otherwise this is a single process.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator service.
        num_processes: total number of processes.
        process_id: this process's index in ``[0, num_processes)``.
        cpu_devices_per_process: simulated CPU devices per process.
        environ: environment to read; defaults to ``os.environ``.

    Returns:
        A `ProcessGroup` saying where the setup came from.

    Raises:
        ShardingError: a partial or invalid setup (every problem at once, each with its fix).
        ArgumentError: an inconsistent torchrun environment (the variables named), or ``RANK`` and
            ``WORLD_SIZE`` of a multi-process run without ``MASTER_ADDR``/``MASTER_PORT``.

    Examples:
        >>> resolve("10.0.0.1:1234", 2, 1, environ={}).source
        'arguments'
    """
    environ = os.environ if environ is None else environ
    explicit: dict[str, Any] = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
        "cpu_devices_per_process": cpu_devices_per_process,
    }
    merged = _merge(explicit, environ)
    fields, problems = _validate(merged)
    if any(merged[k] is not None for k in _CORE):
        problems += _missing(merged)
        raise_if_any(problems, header="cannot set up the process group; pass all three or none")
        source: Source = "arguments" if any(explicit[k] is not None for k in _CORE) else "environment"
        return ProcessGroup(source, **fields)
    raise_if_any(problems, header="cannot set up the process group")
    if torchrun.is_torchrun(environ) or torchrun.half_set(environ):  # half set: parse names what is missing
        return _torchrun_group(torchrun.parse(environ), fields["cpu_devices_per_process"])
    cluster = detect_cluster(environ)
    return ProcessGroup(
        "single" if cluster is None else "cluster",
        cpu_devices_per_process=fields["cpu_devices_per_process"],
        cluster=cluster,
    )


def _torchrun_group(env: torchrun.TorchrunEnv, cpu_devices: int | None) -> ProcessGroup:
    """torchrun's worker: process ``RANK`` of ``WORLD_SIZE``; the coordinator is agreed on when joining.

    With several processes per node and real accelerators, each takes the one at its ``LOCAL_RANK``
    (torchrun's one-process-per-GPU convention); simulated CPU devices are each process's own.
    """
    local = (env.local_rank,) if env.local_world_size > 1 and cpu_devices is None else None
    return ProcessGroup("torchrun", None, env.world_size, env.rank, cpu_devices, local_device_ids=local)


def _configure_runtime(cpu_devices_per_process: int | None) -> None:
    """Simulated CPU devices and CPU cross-process collectives, both before the backend starts."""
    if cpu_devices_per_process is not None:
        use_cpu_devices(cpu_devices_per_process)
    if not jax.config.jax_cpu_collectives_implementation:
        # without a CPU collectives library, a computation spanning processes fails on CPU
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _connect(group: ProcessGroup) -> None:
    _join(group)
    if jax.distributed.is_initialized():  # joined a run: its exit barrier is now in play
        failfast.install()


def _join(group: ProcessGroup) -> None:
    if jax.distributed.is_initialized():
        logger.info("torchshard: jax.distributed is already initialised; joining nothing more")
    elif group.source == "cluster":
        logger.info("torchshard: initialising jax.distributed from the %s environment", group.cluster)
        jax.distributed.initialize()
    elif group.source == "torchrun" and group.num_processes != 1:
        logger.info(
            "torchshard: torchrun process %s of %s, coordinator %s",
            group.process_id,
            group.num_processes,
            group.coordinator_address,
        )
        jax.distributed.initialize(
            group.coordinator_address, group.num_processes, group.process_id, local_device_ids=group.local_device_ids
        )
    elif group.source != "single" and (group.num_processes != 1 or group.coordinator_address is not None):
        logger.info("torchshard: process %s of %s", group.process_id, group.num_processes)
        jax.distributed.initialize(group.coordinator_address, group.num_processes, group.process_id)


_current: ProcessGroup | None = None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices_per_process: int | None = None,
) -> ProcessGroup:
    """Joins this process to a multi-process JAX run; a no-op for a plain single process.

    Call it first thing, before anything touches JAX devices. The setup comes from, in order:
    the arguments; the ``TORCHSHARD_COORDINATOR`` / ``TORCHSHARD_NUM_PROCESSES`` /
    ``TORCHSHARD_PROCESS_ID`` / ``TORCHSHARD_CPU_DEVICES`` variables that
    ``python -m torchshard.launch`` sets; torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
    ``LOCAL_WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` (``srun torchrun`` included: torchrun's
    variables win over SLURM's), with process 0's coordinator on ``MASTER_ADDR`` at a port agreed
    through torchrun's store; a SLURM ``srun`` step, ``mpirun`` or GKE TPU pod with
    several processes, or ``TORCHSHARD_CLUSTER=auto`` (JAX's own ``jax.distributed.initialize()``
    auto-detection). Otherwise nothing happens. On CPU, cross-process collectives use gloo.
    Calling it again with the same setup is a no-op. Once joined, an exception that reaches the top
    of the script ends this process without waiting for the others at JAX's exit barrier (so a
    restart under torchrun is not held up by it); ``atexit`` handlers registered after this call
    still run.

    Args:
        coordinator_address: ``host:port`` of process 0, reachable from every process.
        num_processes: total number of processes.
        process_id: this process's index in ``[0, num_processes)``.
        cpu_devices_per_process: simulated CPU devices per process (CPU testing only).

    Returns:
        The `ProcessGroup` used.

    Raises:
        ShardingError: a partial or invalid setup, JAX already started, or a second call with a
            different setup.
        ArgumentError: an inconsistent torchrun environment (``RANK`` ≥ ``WORLD_SIZE``, a
            ``LOCAL_WORLD_SIZE`` that does not divide it, ``RANK=1 WORLD_SIZE=2`` without
            ``MASTER_ADDR``...), each variable named.

    Examples:
        >>> from torchshard import distributed
        >>> distributed.initialize()  # doctest: +SKIP
        >>> mesh = torchshard.make_mesh({"data": -1})  # doctest: +SKIP
    """
    global _current
    group = resolve(coordinator_address, num_processes, process_id, cpu_devices_per_process=cpu_devices_per_process)
    if _current is not None:
        _check_same(_current, group)
        return _current
    if backend_started() and group.source != "single" and not jax.distributed.is_initialized():
        raise ShardingError(
            "torchshard.distributed.initialize() was called after JAX started its backend; call it first "
            "thing in your program, before jax.devices(), any jax array, torchax tensor or model placement."
        )
    _configure_runtime(group.cpu_devices_per_process)
    if group.source == "torchrun" and group.num_processes != 1 and not jax.distributed.is_initialized():
        group = dataclasses.replace(group, coordinator_address=torchrun.coordinator_address(torchrun.parse(os.environ)))
    _connect(group)
    _current = group
    return group


def _check_same(current: ProcessGroup, group: ProcessGroup) -> None:
    if group.source == "torchrun":  # the coordinator was agreed on when joining
        group = dataclasses.replace(group, coordinator_address=current.coordinator_address)
    if dataclasses.replace(group, source=current.source) != current:
        raise ShardingError(
            f"torchshard.distributed.initialize() was already called with {current}; it cannot change to "
            f"{group}. Call it once, first thing in your program."
        )


def process_index() -> int:
    """This process's index (0 in a single-process run).

    Examples:
        >>> process_index()  # doctest: +SKIP
        0
    """
    return jax.process_index()


def process_count() -> int:
    """Number of processes in the run (1 in a single-process run).

    Examples:
        >>> process_count()  # doctest: +SKIP
        1
    """
    return jax.process_count()


def is_main_process() -> bool:
    """Whether this is process 0, the one that should log, print and write shared files.

    Examples:
        >>> if is_main_process():  # doctest: +SKIP
        ...     print(float(metrics["loss"]))
    """
    return jax.process_index() == 0
