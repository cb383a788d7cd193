"""Which DCP entries are the model's, which its optimizer's, which the training loop's; and optax's names for them.

Layouts read: torchtitan's (model tensors at the top level or under ``model.``, ``optimizer.state.
<param>.<field>``, and ``train_state`` / ``lr_scheduler`` / ``dataloader``), ``get_state_dict``'s
(``{"model": ..., "optimizer": ...}``, nested or ``flatten_optimizer_state_dict``), and a bare
``model.state_dict()``. torch AdamW's ``exp_avg`` / ``exp_avg_sq`` / ``step`` are optax's
``mu`` / ``nu`` / ``count`` (``scale_by_adam``'s state, as ``optax.adamw`` and ``optax.adam`` hold it); a Trainer
on a torch optimizer keeps torch's fields under torch's names.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax

OPTAX_FIELDS = {"mu": "exp_avg", "nu": "exp_avg_sq", "count": "step"}
# every per-parameter field of the torch optimizers a Trainer translates (torchshard/_train/optim/rules.py)
TORCH_FIELDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step", "momentum_buffer", "sum", "square_avg", "grad_avg",
                "row_var", "col_var", "variance")  # fmt: skip
_PREFIX = r"(?:(?:.*\.)?optim(?:izer)?\.)?"
_OPTIMIZER = re.compile(_PREFIX + r"state\.(?P<param>.+)\.(?P<field>" + "|".join(TORCH_FIELDS) + ")")
_GROUP = re.compile(_PREFIX + r"param_groups\.(?P<group>\d+|.+)\.(?P<key>\w+)")
_LOOP = ("train_state.", "lr_scheduler.", "dataloader.")  # torchtitan's training-loop state: not model tensors


@dataclasses.dataclass(frozen=True)
class Entries:
    """A checkpoint's tensor entries by role."""

    model: list[str]  # candidates for model tensors (the prefix still on)
    optimizer: dict[str, tuple[str, str]]  # stored name → (param name, torch field)
    loop: list[str]  # training-loop state: never read


def split(names: Iterable[str]) -> Entries:
    """The tensor entries by role (optimizer state is recognised by its ``state.<param>.<field>`` names).

    Examples:
        >>> split(["model.w", "optimizer.state.w.exp_avg", "train_state.step"]).optimizer
        {'optimizer.state.w.exp_avg': ('w', 'exp_avg')}
    """
    model, optimizer, loop = [], {}, []
    for name in names:
        if (match := _OPTIMIZER.fullmatch(name)) is not None:
            optimizer[name] = (match["param"], match["field"])
        elif name.startswith(_LOOP):
            loop.append(name)
        else:
            model.append(name)
    return Entries(model, optimizer, loop)


def group_entries(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Stored name → (group index, or a parameter's name in ``flatten_optimizer_state_dict``'s layout; key) of the
    ``param_groups`` entries among ``names``.

    Examples:
        >>> group_entries(["optimizer.param_groups.0.lr", "param_groups.fc.weight.lr", "model.w"])
        {'optimizer.param_groups.0.lr': ('0', 'lr'), 'param_groups.fc.weight.lr': ('fc.weight', 'lr')}
    """
    return {n: (m["group"], m["key"]) for n in names if (m := _GROUP.fullmatch(n)) is not None}


def model_prefix(stored: Iterable[str], expected: Iterable[str]) -> str:
    """The prefix most stored names put before a model name (``""``, ``"model."``, ``"app.model."``...).

    Examples:
        >>> model_prefix(["model.0.weight", "model.0.bias"], ["0.weight", "0.bias"])
        'model.'
    """
    wanted = set(expected)
    counts: collections.Counter[str] = collections.Counter()
    for name in stored:
        parts = name.split(".")
        counts.update(".".join(parts[:i]) + "." * (i > 0) for i in range(len(parts)) if ".".join(parts[i:]) in wanted)
    return max(counts, key=lambda p: (counts[p], p == ""), default="")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One optimizer-state leaf a checkpoint can fill: its optax field and, for mu/nu, the param key."""

    field: str
    param: str | None


def optax_slots(opt_state: Any, params: Iterable[str]) -> dict[str, Slot]:
    """Leaf path (``keystr``) → what fills it, for every leaf of an optax state that AdamW's names map to.

    Examples:
        >>> import optax, jax.numpy as jnp
        >>> slots = optax_slots(optax.adamw(1e-3).init({"w": jnp.zeros(2)}), ["w"])
        >>> sorted((s.field, s.param) for s in slots.values())
        [('count', None), ('mu', 'w'), ('nu', 'w')]
    """
    keys = set(params)
    found = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(opt_state):
        names = [getattr(k, "name", None) for k in path]
        fields = [n for n in names if n in OPTAX_FIELDS]
        if len(fields) != 1:
            continue
        param = next((k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in keys), None)
        if (fields[0] == "count") == (param is None):
            found[jax.tree_util.keystr(path)] = Slot(fields[0], param)
    return found


def unmapped_leaves(opt_state: Any, slots: Mapping[str, Slot]) -> list[str]:
    """Leaves of the optax state no checkpoint entry fills (other optimizers' state, schedules' counts)."""
    return [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(opt_state)
        if jax.tree_util.keystr(p) not in slots
    ]
