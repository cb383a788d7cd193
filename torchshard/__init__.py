"""Shard ordinary torch.nn.Modules over a JAX device mesh with regex rules, and train them."""

from torchshard import collectives, distributed, inspect, presets
from torchshard._checkpoint import (
    CheckpointError,
    checkpoint_steps,
    from_torch_state_dict,
    load,
    save,
    save_safetensors,
    to_torch_state_dict,
)
from torchshard._errors import ShardingError, UnusedRuleWarning
from torchshard._mesh import make_mesh, use_cpu_devices
from torchshard._placement import constrain, init_sharded, shard, shard_batch
from torchshard._plan import PlanEntry, ShardingPlan, plan
from torchshard._rules import Rule, Rules, TensorInfo
from torchshard._trainer import Trainer, TrainState
from torchshard._visualize import visualize, visualize_plan

__all__ = [
    "CheckpointError",
    "PlanEntry",
    "Rule",
    "Rules",
    "ShardingError",
    "ShardingPlan",
    "TensorInfo",
    "TrainState",
    "Trainer",
    "UnusedRuleWarning",
    "checkpoint_steps",
    "collectives",
    "constrain",
    "distributed",
    "from_torch_state_dict",
    "init_sharded",
    "inspect",
    "load",
    "make_mesh",
    "plan",
    "presets",
    "save",
    "save_safetensors",
    "shard",
    "shard_batch",
    "to_torch_state_dict",
    "use_cpu_devices",
    "visualize",
    "visualize_plan",
]
