"""What a Trainer accepts: its arguments and each batch, checked before anything moves."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax
import torch
from jax.sharding import Mesh

from torchshard._base.specs import SPEC_HINT, parse_spec, spec_axes
from torchshard._base.validate import instance_problems, int_problems, raise_for_arguments
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.optim.groups import torch_optimizer_problems
from torchshard._train.precision import MixedPrecision
from torchshard._trainer.trackers import tracker_problems

# XLA on CPU aborts ("Expected N threads to join the rendezvous") with ~30 collective-heavy steps queued
CPU_MAX_IN_FLIGHT = 16


def batch_type_problems(leaves: list[Any]) -> list[str]:
    problems = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
            problems.append(f"batch leaf #{i} {tuple(leaf.shape)} is on the meta device (no values); load real data")
        elif not isinstance(leaf, torch.Tensor | np.ndarray | jax.Array | int | float | bool | np.generic):
            problems.append(
                f"batch leaf #{i} is a {type(leaf).__name__} ({leaf!r:.40}); batches hold tensors or arrays"
            )
        elif np.ndim(leaf) > 0 and np.shape(leaf)[0] == 0:
            problems.append(f"batch leaf #{i} {tuple(np.shape(leaf))} has no rows; skip empty batches")
    return problems


def _optimizer_problems(optimizer: Any, model: Any) -> list[str]:
    if isinstance(optimizer, optax.GradientTransformation):
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return torch_optimizer_problems(optimizer, model)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        name = optimizer.__name__
        return [f"optimizer is the class torch.optim.{name}; build it on the model, e.g. {name}(model.parameters())"]
    if callable(optimizer):
        name = getattr(optimizer, "__name__", type(optimizer).__name__)
        return [f"optimizer is the function {name}, not a GradientTransformation; call it, e.g. optax.{name}(1e-3)"]
    return [
        f"optimizer must be a torch.optim.Optimizer on the model's parameters or an optax GradientTransformation "
        f"such as optax.adamw(1e-3), got {type(optimizer).__name__}"
    ]


def max_grad_norm_problems(value: Any) -> list[str]:
    """``Trainer(max_grad_norm=)`` must be None or a positive finite number.

    Examples:
        >>> max_grad_norm_problems(0.0)
        ['max_grad_norm=0.0 must be a positive number (clip the global gradient norm to it, e.g. 1.0) or None']
    """
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if value is None or (number and math.isfinite(value) and value > 0):
        return []
    return [
        f"max_grad_norm={value!r} must be a positive number (clip the global gradient norm to it, e.g. 1.0) or None"
    ]


def check_trainer_args(
    model: Any,
    loss_fn: Any,
    optimizer: Any,
    plan: Any,
    batch_spec: Any,
    grad_accum_steps: Any,
    max_in_flight: Any,
    precision: Any,
    *,
    donate: Any,
    seed: Any,
    skip_nonfinite: Any,
    max_grad_norm: Any = None,
    observing: tuple[Any, Any, Any] = (None, (), None),
) -> None:
    """Raises one `ArgumentError` listing every argument of ``Trainer(...)`` that is unusable."""
    problems = instance_problems("model", model, torch.nn.Module, "a torch.nn.Module")
    problems += [] if callable(loss_fn) else [f"loss_fn must be a function loss_fn(model, batch), got {loss_fn!r:.40}"]
    problems += _optimizer_problems(optimizer, model) + max_grad_norm_problems(max_grad_norm)
    problems += instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    if isinstance(plan, ShardingPlan) and not isinstance(plan.mesh, Mesh):
        problems.append("plan is over an AbstractMesh (no devices): plan the model on a mesh from make_mesh to train")
    problems += int_problems("grad_accum_steps", grad_accum_steps, minimum=1)
    problems += int_problems("max_in_flight", max_in_flight, minimum=1)
    problems += int_problems("seed", seed, minimum=0)
    if isinstance(plan, ShardingPlan) and isinstance(plan.mesh, Mesh) and isinstance(max_in_flight, int):
        cpu = plan.mesh.devices.flat[0].platform == "cpu"
        if cpu and max_in_flight > CPU_MAX_IN_FLIGHT:
            problems.append(
                f"max_in_flight={max_in_flight}: XLA on CPU aborts with ~30 steps queued; use at most "
                f"{CPU_MAX_IN_FLIGHT}"
            )
    problems += [
        f"{n}={v!r} must be True or False"
        for n, v in (("donate", donate), ("skip_nonfinite", skip_nonfinite))
        if not isinstance(v, bool)
    ]
    if precision is not None:
        problems += instance_problems("precision", precision, MixedPrecision, "None or a torchshard.MixedPrecision")
    spec = parse_spec(batch_spec)
    if spec is None:
        problems.append(f"batch_spec={batch_spec!r} is not {SPEC_HINT}")
    elif isinstance(plan, ShardingPlan):
        unknown = [a for a in spec_axes(spec) if a not in plan.mesh.shape]
        problems += [f"batch_spec axis {a!r} is not in the mesh {list(plan.mesh.shape)}" for a in unknown]
    problems += observing_problems(*observing)
    raise_for_arguments(problems, header="invalid Trainer arguments")


def observing_problems(log_every: Any, trackers: Any, peak: Any) -> list[str]:
    """What is wrong with ``Trainer(log_every=, trackers=, peak_flops=)``."""
    problems = int_problems("log_every", log_every, minimum=1, none="log nothing")
    problems += tracker_problems(trackers)
    if peak is not None and not (isinstance(peak, int | float) and not isinstance(peak, bool) and peak > 0):
        problems.append(f"peak_flops={peak!r} must be a positive number (FLOP/s per device, e.g. 989e12) or None")
    return problems
