"""Multi-process (multi-host) runs on JAX's multi-controller runtime, and each process's part of a batch."""

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
    "process_count",
    "process_index",
    "resolve",
]
