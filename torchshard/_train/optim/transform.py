"""A torch optimizer as the optax transformation a Trainer steps with: torch's per-parameter state, sharded like its
parameter, and every group's hyperparameters as inputs of the compiled step, written from ``param_groups`` before
each step (so an LR scheduler the user steps changes them without recompiling)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax.sharding import NamedSharding, PartitionSpec

from torchshard._base.validate import raise_for_arguments
from torchshard._sharding.placement import put
from torchshard._sharding.plan import ShardingPlan
from torchshard._train.optim.groups import flag_problems, group_names, hyperparameters, rule_for
from torchshard._train.optim.loaded import Start, stacked, start
from torchshard._train.optim.rules import Rule
from torchshard._train.state import StateLayout, TrainState


class TorchState(NamedTuple):
    """The optimizer state of a translated torch optimizer.

    Attributes:
        hyper: ``[param groups, hyperparameters]`` float32, replicated: each group's values (``lr``, ``beta1``...,
            in its rule's order), written from ``param_groups`` before every step.
        state: train-state key → torch's state of that parameter under torch's field names (``exp_avg``,
            ``exp_avg_sq``, ``step``...), as ``optimizer.state[p]`` holds it; a parameter in no group has none.
    """

    hyper: jax.Array
    state: dict[str, dict[str, jax.Array]]


def _float(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class Translation:
    """A torch optimizer's param groups and state, keyed as the train state keys its parameters."""

    optimizer: torch.optim.Optimizer
    rule: Rule
    flags: tuple[dict[str, bool], ...]  # each group's program-changing choices, as the Trainer was built
    by_name: Mapping[str, int]  # canonical parameter name → its param group (one in no group is left as it is)
    start: Start  # state the optimizer already held (a loaded state_dict, Adagrad's filled sum), by train-state key
    replicated: NamedSharding
    _found: dict[str, tuple[int | None, int]] = dataclasses.field(default_factory=dict)

    def where(self, key: str) -> tuple[int | None, int]:
        """(param group or None, leading layer dims) of a train-state key in any layout: a parameter's name, or
        a scanned stack's ``prefix.*.suffix`` (a checkpoint saved with or without scan_layers reads either)."""
        if key not in self._found:
            if key in self.by_name or "*" not in key:
                self._found[key] = (self.by_name.get(key), 0)
            else:
                layers = re.compile(re.escape(key).replace(r"\*", r"\d+"))
                groups = {g for n, g in self.by_name.items() if layers.fullmatch(n)}
                self._found[key] = (groups.pop() if len(groups) == 1 else None, 1)
        return self._found[key]

    def _fresh(self, key: str, param: jax.Array) -> dict[str, jax.Array]:
        group, lead = self.where(key)
        assert group is not None
        axes = tuple(range(lead, param.ndim))
        fields = self.rule.fields(self.flags[group], tuple(param.shape), axes)
        fields["step"] = tuple(param.shape[:lead])  # torch keeps one per parameter: one per layer of a stack
        fills = {f: float(self.optimizer.defaults[d]) for f, d in self.rule.fills.items()}
        slots = {}
        for field, shape in fields.items():
            dtype = jnp.float32 if field == "step" else param.dtype
            given = self.start.get(key, {}).get(field)
            if given is not None and given.shape == shape and np.all(given == given.flat[0]):
                slots[field] = jnp.full(shape, given.flat[0], dtype)  # one value: no constant of the state's size
            elif given is not None and given.shape == shape:
                slots[field] = jnp.asarray(given, dtype)
            else:
                slots[field] = jnp.full(shape, fills.get(field, 0.0), dtype)
        return slots

    def init(self, params: Mapping[str, jax.Array]) -> TorchState:
        hyper = jnp.asarray(self.hyperparameters())
        return TorchState(hyper, {k: self._fresh(k, p) for k, p in params.items() if self.where(k)[0] is not None})

    def update(self, grads: Mapping[str, jax.Array], state: TorchState, params: Any = None) -> tuple[Any, TorchState]:
        assert params is not None  # torch's rules read the parameter (weight decay, Adafactor's scale)
        names = list(self.rule.hyper)
        deltas, new = {}, {}
        for key, grad in grads.items():
            group, lead = self.where(key)
            if group is None:  # torch leaves a parameter in no group as it is
                deltas[key] = jnp.zeros_like(grad)
                continue
            param, slots = params[key], state.state[key]
            hyper = dict(zip(names, state.hyper[group], strict=True))
            hyper["dtype_eps"] = jnp.float32(jnp.finfo(param.dtype).eps)  # Adafactor's eps[0]=None
            cast = {f: v.astype(_float(v.dtype)) for f, v in slots.items()}
            cast["step"] = cast["step"].reshape(cast["step"].shape + (1,) * (param.ndim - lead))  # broadcasts
            as_float = _float(param.dtype)
            axes = tuple(range(lead, param.ndim))
            delta, out = self.rule.update(
                grad.astype(as_float), param.astype(as_float), cast, hyper, self.flags[group], axes
            )
            deltas[key] = delta.astype(param.dtype)
            new[key] = {f: v.reshape(slots[f].shape).astype(slots[f].dtype) for f, v in out.items()}
        return deltas, TorchState(state.hyper, new)

    def transform(self) -> optax.GradientTransformation:
        """The optax transformation: state from `init`, torch's update rule per parameter group."""
        return optax.GradientTransformation(self.init, self.update)

    def hyperparameters(self) -> np.ndarray:
        """Every group's hyperparameters as ``param_groups`` holds them now.

        Raises:
            ArgumentError: a value that is no number, a group added or a program-changing choice made since.
        """
        groups = self.optimizer.param_groups
        rows, problems = hyperparameters(self.rule, groups)
        problems = flag_problems(self.rule, groups, self.flags) + problems
        raise_for_arguments(problems, header="trainer.optimizer's param groups cannot be stepped")
        return rows

    def adopt(self, hyper: np.ndarray) -> None:
        """Writes a train state's hyperparameters (a checkpoint's) into ``param_groups``, where they differ from
        what the groups hold to float32 precision (the precision the step reads them in); each as the shortest
        decimal that float32 value prints as, so an ``lr`` of 0.025 comes back as 0.025."""
        groups = self.optimizer.param_groups
        now, _ = hyperparameters(self.rule, groups)
        if now.shape != hyper.shape:
            return  # another optimizer's: a checkpoint's loader names it
        for group, row, current in zip(groups, hyper, now, strict=True):
            for (key, index), value, was in zip(self.rule.hyper.values(), row, current, strict=True):
                if value != was:
                    _set(group, key, index, float(str(np.float32(value))))

    def refresh(self, state: TrainState) -> TrainState:
        """``state`` with the hyperparameters ``param_groups`` holds now (an input of the compiled step)."""
        hyper = put(self.hyperparameters(), self.replicated, what="the optimizer's hyperparameters")
        # the step about to run is this optimizer's step: torch's schedulers warn when stepped before one
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return state._replace(opt_state=state.opt_state._replace(hyper=hyper))


def _set(group: dict[str, Any], key: str, index: int | None, value: float) -> None:
    """``group[key]`` (or its ``index``-th item, as in ``betas``) set to ``value``; a tensor is filled in place."""
    if index is not None:
        group[key] = tuple(value if i == index else v for i, v in enumerate(group[key]))
    elif isinstance(group[key], torch.Tensor):
        group[key].fill_(value)
    else:
        group[key] = value


def translate(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, plan: ShardingPlan, layout: StateLayout
) -> Translation:
    """``optimizer`` (checked by `torch_optimizer_problems`) keyed by train-state key, before the model moves.

    Raises:
        ArgumentError: the layers of one scanned stack are in different param groups.
    """
    rule = rule_for(optimizer)
    assert rule is not None  # checked with the Trainer's arguments
    by_name = {plan.canonical(n): i for i, names in enumerate(group_names(optimizer, model)) for n in names}
    stacks, problems = layout.stacks(), []
    for key, layers in stacks.items():
        found = {by_name.get(n) for n in layers}
        if len(found) > 1:
            problems.append(
                f"{key}: the scanned layers are in different param groups ({sorted(found, key=str)}), but a scan "
                f"stacks them into one array stepped with one group's values; put them in one group"
            )
    raise_for_arguments(problems, header="invalid Trainer arguments")
    held = start(optimizer, {id(p): plan.canonical(n) for n, p in model.named_parameters()})
    fills = {f: float(optimizer.defaults[d]) for f, d in rule.fills.items()}
    keys = layout.keys(list(by_name))
    return Translation(
        optimizer,
        rule,
        tuple(rule.flags(g) for g in optimizer.param_groups),
        by_name,
        {k: s for k in keys if (s := stacked(held, k, stacks, fills))},
        NamedSharding(plan.mesh, PartitionSpec()),
    )
