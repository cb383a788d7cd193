"""Multi-process (multi-host) runs on JAX's multi-controller runtime, and each process's part of a batch."""

from typing import Any

from torchshard._base.validate import instance_problems, raise_for_arguments
from torchshard._multihost.preemption import preempted_at
from torchshard._multihost.runtime import (
    CLUSTER_ENV,
    COORDINATOR_ENV,
    CPU_DEVICES_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    ProcessGroup,
    detect_cluster,
    initialize,
    is_main_process,
    process_count,
    process_index,
    resolve,
)
from torchshard._multihost.worker import heartbeat
from torchshard._sharding.process import global_shape, local_batch_slice
from torchshard._trainer.trainer import Trainer

__all__ = [
    "CLUSTER_ENV",
    "COORDINATOR_ENV",
    "CPU_DEVICES_ENV",
    "NUM_PROCESSES_ENV",
    "PROCESS_ID_ENV",
    "ProcessGroup",
    "detect_cluster",
    "global_shape",
    "heartbeat",
    "initialize",
    "is_main_process",
    "local_batch_slice",
    "preempted",
    "process_count",
    "process_index",
    "resolve",
]


def preempted(trainer: Any) -> bool:
    """Whether the run is being preempted: True on every process at the same step once any process got SIGTERM.

    The first call installs a SIGTERM handler (before it, SIGTERM ends the process as usual; a
    second SIGTERM after the first goes to the handler that was there before, so it still ends it);
    JAX's preemption notice (``multihost_utils.reached_preemption_sync_point``) counts too where
    the platform gives one. Every process must call it once per step at the same point of its
    loop: it agrees through a tiny collective (the max of one flag per process). Save and exit
    when it says True; ``python -m torchshard.launch`` forwards SIGTERM to its processes and
    gives them time to do so, and so does torchrun (30 s before it kills them).

    Args:
        trainer: the `Trainer` being trained (its step count is the step agreed on).

    Returns:
        True from the agreed step on.

    Raises:
        ArgumentError: ``trainer`` is not a Trainer.

    Examples:
        >>> import optax
        >>> model = torch.nn.Linear(16, 4)
        >>> trainer = ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.sgd(0.1),
        ...                      ts.plan(model, ts.make_mesh({"data": 8})))
        >>> for step in range(3):
        ...     _ = trainer.step(torch.randn(8, 16))
        ...     if preempted(trainer):
        ...         break  # ts.save(root, trainer); sys.exit(0)
        >>> trainer.step_count
        3
    """
    raise_for_arguments(
        instance_problems("trainer", trainer, Trainer, "a torchshard.Trainer"), header="invalid preempted() arguments"
    )
    return preempted_at(trainer.step_count)
