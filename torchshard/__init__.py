"""Shard ordinary torch.nn.Modules over a JAX device mesh with regex rules, and train them."""

from torchshard import collectives, distributed, presets, track
from torchshard import inspect as inspect
from torchshard._base.errors import ArgumentError, CheckpointError, ShardingError, TrackerError, UnusedRuleWarning
from torchshard._bridge.ops.linear_cross_entropy import linear_cross_entropy
from torchshard._ckpt.checkpoint import save
from torchshard._ckpt.load import load
from torchshard._ckpt.stepdir import checkpoint_steps
from torchshard._generate.generate import generate
from torchshard._interop.adapters import save_adapters
from torchshard._interop.dcp_load import load_dcp
from torchshard._interop.dcp_save import save_dcp
from torchshard._interop.export import from_torch_state_dict, to_torch_state_dict
from torchshard._interop.optim_state import optimizer_state_dict
from torchshard._interop.pretrained import load_safetensors
from torchshard._interop.safetensors import save_safetensors
from torchshard._report.visualize import visualize, visualize_plan
from torchshard._sharding.batch import shard_batch
from torchshard._sharding.constrain import constrain
from torchshard._sharding.mesh import make_mesh, use_cpu_devices
from torchshard._sharding.placement import shard
from torchshard._sharding.plan import PlanEntry, ShardingPlan, plan
from torchshard._sharding.rules import Rule, Rules, TensorInfo
from torchshard._strategies.context.context import ContextParallelWarning
from torchshard._strategies.context.documents import document_mask
from torchshard._strategies.context.option import ContextParallel
from torchshard._strategies.experts.experts import ExpertDispatchWarning
from torchshard._strategies.experts.option import ExpertDispatch
from torchshard._strategies.pipeline.option import Pipeline
from torchshard._train.precision import MixedPrecision
from torchshard._train.remat import Remat
from torchshard._train.scan import ScanLayersWarning
from torchshard._train.state import TrainState
from torchshard._trainer.prefetch import prefetch
from torchshard._trainer.staged_init import init_sharded
from torchshard._trainer.trainer import Trainer

# `inspect` stays an attribute (ts.inspect.collectives) but is left out of __all__: under
# `from torchshard import *` it would shadow the standard library's inspect module.
__all__ = [
    "ArgumentError",
    "CheckpointError",
    "ContextParallel",
    "ContextParallelWarning",
    "ExpertDispatch",
    "ExpertDispatchWarning",
    "MixedPrecision",
    "Pipeline",
    "PlanEntry",
    "Remat",
    "Rule",
    "Rules",
    "ScanLayersWarning",
    "ShardingError",
    "ShardingPlan",
    "TensorInfo",
    "TrackerError",
    "TrainState",
    "Trainer",
    "UnusedRuleWarning",
    "checkpoint_steps",
    "collectives",
    "constrain",
    "distributed",
    "document_mask",
    "from_torch_state_dict",
    "generate",
    "init_sharded",
    "linear_cross_entropy",
    "load",
    "load_dcp",
    "load_safetensors",
    "make_mesh",
    "optimizer_state_dict",
    "plan",
    "prefetch",
    "presets",
    "save",
    "save_adapters",
    "save_dcp",
    "save_safetensors",
    "shard",
    "shard_batch",
    "to_torch_state_dict",
    "track",
    "use_cpu_devices",
    "visualize",
    "visualize_plan",
]
