"""The one state a Trainer's parts share: its options, module, plan, train state and compiled functions."""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import jax
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._bridge.layer_view import StackedArray
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.batching import BatchLayout
from torchshard._train.optim.given import GivenOptimizer
from torchshard._train.precision import MixedPrecision, stored_dtypes
from torchshard._train.remat import Remat
from torchshard._train.scan import ScanLike
from torchshard._train.state import Arrays, StateLayout, TrainState
from torchshard._train.strategy import Bound
from torchshard._trainer.evaluate import Compiled
from torchshard._trainer.retracing import Retracing


@dataclasses.dataclass(frozen=True)
class Options:
    """The Trainer's keyword arguments that shape its step, as checked by `check_trainer_args`."""

    batch_spec: PartitionSpec
    grad_accum_steps: int
    donate: bool
    seed: int
    max_in_flight: int
    precision: MixedPrecision | None
    remat: Remat | None
    scan_layers: ScanLike
    skip_nonfinite: bool
    max_grad_norm: float | None


@dataclasses.dataclass(eq=False)
class Core:
    """What every part of a `Trainer` reads, and what a step, a load or an evaluation advances.

    Built once by `assemble`; the parts (`StateIO`, `Observer`, the holding, the strategy views)
    each receive it. Mutable on purpose: a step replaces ``state`` (its arrays were donated),
    `load_state` replaces ``state``, ``frozen`` and ``base_key``; the rest is set once.
    """

    options: Options
    plan: ShardingPlan  # as the strategies laid it out (a pipeline's stages in its table)
    model: torch.nn.Module
    layout: StateLayout
    given: GivenOptimizer
    batch: BatchLayout
    strategies: dict[str, Bound]
    replicated: NamedSharding
    names: tuple[list[str], list[str], list[str]]  # trainable params, buffers, frozen params
    tensors: dict[str, Any]  # the module's tensors by name, bound to the state's arrays after each step
    stacks: dict[str, StackedArray]  # scanned layers' tensors are views of these stacked arrays
    state: TrainState
    frozen: Arrays
    base_key: jax.Array
    step_fn: Retracing
    evaluations: Compiled
    lock: threading.RLock
    in_flight: collections.deque[jax.Array] = dataclasses.field(default_factory=collections.deque)
    trained_on: Any = None  # the structure of the batches steps took, which evaluate checks against

    @property
    def mesh(self) -> Mesh:
        """The device mesh the plan places tensors on."""
        mesh = self.plan.mesh
        assert isinstance(mesh, Mesh)  # checked when the Trainer was built
        return mesh

    def dtypes(self) -> dict[str, torch.dtype]:
        """The torch dtype each tensor is stored in (the master dtype under `MixedPrecision`)."""
        return stored_dtypes(self.plan, self.options.precision)

    def throttle(self, marker: jax.Array) -> None:
        """Queues a step's ``marker``; waits for the oldest while more than ``max_in_flight`` are queued."""
        self.in_flight.append(marker)
        while len(self.in_flight) > self.options.max_in_flight:
            self.in_flight.popleft().block_until_ready()

    def drain(self) -> None:
        """Waits for every queued step."""
        while self.in_flight:
            self.in_flight.popleft().block_until_ready()
