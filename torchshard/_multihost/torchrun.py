"""torchrun's environment: who this process is, and where process 0's JAX coordinator listens.

torchrun (and ``srun torchrun``, and operators such as Kubeflow's PyTorchJob) describe a worker with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.
``MASTER_ADDR`` is rank 0's host by torch's convention, so the coordinator runs there. Its port must
not be ``MASTER_PORT`` (torchrun's store listens there). Under torchrun's agent store
(``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's default) process 0 picks a free port once and
publishes it in that store; every later process, and every restart of the group, reads the same
one. A restart of a group whose rank 0 moved to another host gets a new store, so a value is never
stale. Without an agent store (no one may be listening at ``MASTER_PORT`` yet) the port is
``MASTER_PORT + 1``.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
from collections.abc import Mapping

from torchshard._base.errors import ShardingError
from torchshard._base.validate import raise_for_arguments

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
PORT_KEY = "torchshard/coordinator_port"
PORT_OFFSET = 1  # the coordinator's port when no agent store can be asked: MASTER_PORT + 1
STORE_TIMEOUT_S = 600.0  # process 0 may still be importing torch and JAX
_INTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class TorchrunEnv:
    """One process as torchrun describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    agent_store: bool


def is_torchrun(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is a torchrun worker's (or another launcher's that sets torch's variables).

    Examples:
        >>> is_torchrun({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}), is_torchrun({"RANK": "0"})
        (True, False)
    """
    return RUN_ID_ENV in environ or all(k in environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def half_set(environ: Mapping[str, str]) -> bool:
    """Whether ``RANK`` and ``WORLD_SIZE`` describe a process of several, without what joins them (no
    ``MASTER_ADDR``, no torchrun agent): `parse` names what is missing rather than this running alone.

    Examples:
        >>> half_set({"RANK": "1", "WORLD_SIZE": "2"}), half_set({"RANK": "0", "WORLD_SIZE": "1"})
        (True, False)
    """
    pair = (environ.get("RANK", "").strip(), environ.get("WORLD_SIZE", "").strip())
    return "RANK" in environ and "WORLD_SIZE" in environ and not is_torchrun(environ) and pair != ("0", "1")


def _ints(environ: Mapping[str, str]) -> tuple[dict[str, int], list[str]]:
    found, problems = {}, []
    for name in _INTS:
        text = environ.get(name)
        if text is None:
            continue
        try:
            found[name] = int(text)
        except ValueError:
            problems.append(f"${name}={text!r} is not an integer")
    return found, problems


def _range_problems(n: Mapping[str, int]) -> list[str]:
    """Each count positive and each index inside its count."""
    problems = [f"${k}={n[k]} must be ≥ 1" for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE") if k in n and n[k] < 1]
    for index, count in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if index in n and not 0 <= n[index] < max(n.get(count, 1), 1):
            problems.append(f"${index}={n[index]} must be in [0, ${count}={n.get(count, 1)})")
    if "MASTER_PORT" in n and not 0 < n["MASTER_PORT"] < 2**16:
        problems.append(f"$MASTER_PORT={n['MASTER_PORT']} must be a TCP port in [1, 65535]")
    return problems


def _node_problems(world: int, local: int, rank: int, local_rank: int) -> list[str]:
    """Every node runs the same number of processes (a JAX mesh needs as many devices on each host)."""
    if local > world or world % local:
        return [
            f"$LOCAL_WORLD_SIZE={local} does not divide $WORLD_SIZE={world}; run the same --nproc-per-node on "
            f"every node"
        ]
    if rank % local != local_rank:
        return [
            f"$LOCAL_RANK={local_rank} does not fit $RANK={rank} with $LOCAL_WORLD_SIZE={local} (expected "
            f"{rank % local}); the launcher set an inconsistent environment"
        ]
    return []


def parse(environ: Mapping[str, str]) -> TorchrunEnv:
    """This process's place in a torchrun job, checked (every problem at once).

    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` default to one process per node; ``MASTER_ADDR`` and
    ``MASTER_PORT`` are needed for more than one process.

    Raises:
        ArgumentError: a variable that is not an integer, out of range, or inconsistent with another.

    Examples:
        >>> parse({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        ...        "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}).local_rank
        1
    """
    n, problems = _ints(environ)
    missing = [k for k in ("RANK", "WORLD_SIZE") if k not in environ]
    if n.get("WORLD_SIZE", 1) > 1:
        missing += [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in environ]
    problems += [f"${k} is not set" for k in missing]
    problems += _range_problems(n)
    world, rank = n.get("WORLD_SIZE", 1), n.get("RANK", 0)
    local, local_rank = n.get("LOCAL_WORLD_SIZE", 1), n.get("LOCAL_RANK", 0)
    if not problems:
        problems += _node_problems(world, local, rank, local_rank)
    fix = "start the script with torchrun (or set torch's variables consistently), or unset them for one process"
    raise_for_arguments([f"{p}; {fix}" for p in problems], header="invalid torchrun environment")
    agent = environ.get(AGENT_STORE_ENV) == str(True)
    return TorchrunEnv(rank, world, local_rank, local, environ.get("MASTER_ADDR"), n.get("MASTER_PORT"), agent)


def _free_port(host: str) -> int:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    except OSError:  # a name this host does not bind to directly (a NAT'd or aliased name): any interface
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]


def _agreed_port(env: TorchrunEnv) -> int:
    """The port process 0 published in torchrun's store (it publishes one the first time, then keeps it)."""
    from torch.distributed import TCPStore

    assert env.master_addr is not None and env.master_port is not None
    try:
        store = TCPStore(
            env.master_addr,
            env.master_port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
        )
        if env.rank == 0:  # first writer wins: a restarted group reuses the port its first process 0 chose
            return int(store.compare_set(PORT_KEY, "", str(_free_port(env.master_addr))).decode())
        return int(store.get(PORT_KEY).decode())  # waits until process 0 has published it
    except (RuntimeError, OSError) as e:  # torch's DistStoreError is a RuntimeError
        raise ShardingError(
            f"process {env.rank} cannot agree on the JAX coordinator's port through torchrun's store at "
            f"$MASTER_ADDR:$MASTER_PORT = {env.master_addr}:{env.master_port} ({type(e).__name__}: {e}); start the "
            f"script with torchrun, or set {AGENT_STORE_ENV}=False to use $MASTER_PORT + {PORT_OFFSET}"
        ) from e


def coordinator_address(env: TorchrunEnv) -> str:
    """``host:port`` of process 0's JAX coordinator (agreed through torchrun's store where there is one).

    Raises:
        ShardingError: torchrun's store cannot be reached, or process 0 never published the port.
    """
    assert env.master_addr is not None and env.master_port is not None
    port = _agreed_port(env) if env.agent_store else env.master_port + PORT_OFFSET
    return f"{env.master_addr}:{port}"
