"""DCP's ``get_optimizer_state_dict`` layout for a Trainer on a torch optimizer: what `save_dcp` writes, and a
checkpoint's torch optimizer state and param groups (FSDP2's, torchtitan's, `save_dcp`'s) read into the Trainer.

The layout: ``optimizer.state.<name>.<field>`` per parameter, by its name in ``model.named_parameters()``, and
``optimizer.param_groups.<i>.<key>`` (non-tensor entries; ``params`` lists the names). torchtitan's
``flatten_optimizer_state_dict`` keeps ``param_groups.<name>.<key>`` per parameter instead; both are read.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch

from torchshard._ckpt.restore import Destination
from torchshard._interop.loading import SliceBuilder
from torchshard._interop.optim_state import held, param_groups, translation_of
from torchshard._interop.renames import Rename, renamer
from torchshard._sharding.placement import put
from torchshard._train.optim.transform import TorchState
from torchshard._trainer.trainer import Trainer

if TYPE_CHECKING:  # dcp_io imports torch.distributed.checkpoint: see dcp_load._read
    from torchshard._interop.dcp_io import BoxReader


def torch_entries(trainer: Trainer) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """The names ``dcp.save(get_state_dict(...))`` gives a torch optimizer's state: ``optimizer.state.<name>.<field>``
    → array (a scanned stack's layer sliced out), and ``optimizer.param_groups.<i>.<key>`` → value."""
    arrays = {}
    for h in held(trainer):
        for field, array in h.fields.items():
            arrays[f"optimizer.state.{h.name}.{field}"] = array if h.layer is None else array[h.layer]
    groups = param_groups(trainer.optimizer, [list(n) for n in trainer.given_optimizer.names])  # type: ignore[arg-type]
    objects = {f"optimizer.param_groups.{i}.{k}": v for i, group in enumerate(groups) for k, v in group.items()}
    return arrays, objects


class TorchOptimizer:
    """A checkpoint's torch optimizer state mapped onto a Trainer's translated torch optimizer.

    ``stored``: the checkpoint's state entries, stored name → (parameter name, field); ``groups``: its
    ``param_groups`` entries, stored name → (group index or parameter name, key).
    """

    def __init__(
        self,
        trainer: Trainer,
        dest: Destination,
        stored: Mapping[str, tuple[str, str]],
        groups: Mapping[str, tuple[str, str]],
        rename: Rename | None,
    ) -> None:
        self.trainer, self.dest, self.groups = trainer, dest, dict(groups)
        self.translation = translation_of(trainer)
        self.kind = type(trainer.optimizer).__name__
        rename_one = self.rename = renamer(rename)
        self.entries: dict[tuple[str, str], str] = {}  # (canonical name, field) → stored name
        self.strays: list[str] = []  # state of parameters the model does not have
        for name, (param, field) in stored.items():
            canon = dest.names.get(rename_one(param) or "")
            if canon is None:
                self.strays.append(name)
            else:
                self.entries[(canon, field)] = name
        shapes = jax.eval_shape(trainer.transform.init, dict(trainer.state.params)).state
        hidden = self.translation.rule.hidden
        self.fields = {k: {f: tuple(s.shape[1:] if k in dest.stacks else s.shape) for f, s in slots.items()
                           if f not in hidden} for k, slots in shapes.items()}  # fmt: skip
        self.values: dict[int, dict[str, Any]] = {}  # each param group's values as read, where they fit

    def _canonical(self, stored: str) -> str:
        """A parameter name of the checkpoint as the model's canonical name (renamed first; itself if unknown)."""
        name = self.rename(stored) or stored
        return self.dest.names.get(name, name)

    def layers(self, key: str) -> list[str]:
        return self.dest.stacks.get(key) or [key]

    def problems(self, reader: BoxReader, *, strict: bool) -> list[str]:
        """Every missing, mis-shaped and unexpected state tensor and every param group that does not fit."""
        problems, wanted = [], set()
        for key, fields in self.fields.items():
            for layer in self.layers(key):
                for field, shape in fields.items():
                    wanted.add((layer, field))
                    name = self.entries.get((layer, field))
                    if name is None:
                        problems += [f"missing optimizer state {layer}.{field} {shape}"] if strict else []
                    elif reader.tensors[name].shape != shape:
                        problems.append(f"mis-shaped {name}: checkpoint {reader.tensors[name].shape}, Trainer {shape}")
        if strict:
            problems += [f"unexpected optimizer state {n}: its parameter is not in the model" for n in self.strays]
            extra: dict[str, list[str]] = {}
            for param, field in self.entries:
                if (param, field) not in wanted:
                    extra.setdefault(param, []).append(field)
            problems += [
                f"unexpected optimizer state of {param} ({', '.join(fields)}): the Trainer's torch.optim.{self.kind}, "
                f"with its options, keeps none of it; build it with the optimizer that saved the checkpoint"
                for param, fields in extra.items()
            ]
        return problems + self._group_problems(reader, strict=strict)

    def _read_groups(self, reader: BoxReader) -> dict[int, dict[str, Any]]:
        """Each param group's values in the checkpoint, by group index (per-parameter entries: by the group of
        their parameter, in this Trainer's optimizer)."""
        from torchshard._interop.dcp_io import read_objects  # see dcp_load._read

        read = read_objects(reader.root, reader.reader.read_metadata(), list(self.groups))
        by_name = {self.dest.names.get(n, n): i for i, names in enumerate(self.trainer.given_optimizer.names)
                   for n in names}  # fmt: skip
        found: dict[int, dict[str, Any]] = {}
        for stored, (where, key) in self.groups.items():
            index = int(where) if where.isdigit() else by_name.get(self._canonical(where))
            if index is not None and not (key == "params" and not where.isdigit()):
                found.setdefault(index, {}).setdefault(key, read[stored])
        return found

    def _group_problems(self, reader: BoxReader, *, strict: bool) -> list[str]:
        """Why the checkpoint's param groups do not fit the optimizer's; the ones that fit are kept to apply."""
        groups = self.trainer.optimizer.param_groups  # type: ignore[union-attr]
        read = self._read_groups(reader) if self.groups else {}
        problems = []
        if read and max(read) >= len(groups):
            problems.append(
                f"the checkpoint has {max(read) + 1} param groups, the Trainer's optimizer {len(groups)}: build it "
                f"with the param groups that saved the checkpoint"
            )
        for i, values in sorted(read.items()):
            wrong = self._group_fit(i, values) if i < len(groups) else ["(counted above)"]
            problems += [f"param group {i}: {w}" for w in wrong if i < len(groups)]
            if not wrong:
                self.values[i] = {k: v for k, v in values.items() if k != "params"}
        return problems if strict else []

    def _group_fit(self, index: int, values: Mapping[str, Any]) -> list[str]:
        group = self.trainer.optimizer.param_groups[index]  # type: ignore[union-attr]
        wrong = []
        if "params" in values:
            mine = [self.dest.names.get(n, n) for n in self.trainer.given_optimizer.names[index]]
            theirs = [self._canonical(n) for n in values["params"]]
            if theirs != mine:
                wrong.append(
                    f"the checkpoint's group holds {theirs[:4]}{' ...' if len(theirs) > 4 else ''}, the Trainer's "
                    f"{mine[:4]}{' ...' if len(mine) > 4 else ''}: build the optimizer with the same param groups"
                )
        try:
            flags = self.translation.rule.flags({**group, **values})
        except (KeyError, IndexError, TypeError, ValueError):
            return [*wrong, f"the checkpoint's values {dict(values)!r:.80} cannot be read"]
        built = self.translation.flags[index]
        wrong += [
            f"the checkpoint's {name} is {flags[name]}, the Trainer's optimizer was built with {built[name]}: build "
            f"it with the options that saved the checkpoint"
            for name in built
            if flags[name] != built[name]
        ]
        return wrong

    def state(
        self, reader: BoxReader, params: Mapping[str, jax.Array], dtypes: Mapping[str, torch.dtype], *, strict: bool
    ) -> tuple[TorchState, int | None]:
        """The param groups' values applied, then the state (read where the checkpoint has it, fresh elsewhere) and
        the largest step (the Trainer's step count; None when the checkpoint keeps none, as SGD's)."""
        for index, values in self.values.items():
            self.trainer.optimizer.param_groups[index].update(values)  # type: ignore[union-attr]
        shardings = self.trainer.state_shardings().opt_state
        fresh = jax.jit(self.trainer.transform.init, out_shardings=shardings)(dict(params))
        hyper = put(self.translation.hyperparameters(), self.translation.replicated, what="the hyperparameters")
        state = {key: {f: self._array(reader, key, f, like) for f, like in slots.items()} for key, slots in
                 fresh.state.items()}  # fmt: skip
        steps = {float(reader.read(n, ())) for (_, field), n in self.entries.items() if field == "step"}
        reader.release()
        return TorchState(hyper, state), int(max(steps)) if steps else None

    def _array(self, reader: BoxReader, key: str, field: str, like: jax.Array) -> jax.Array:
        layers = self.layers(key)
        if field not in self.fields[key]:  # SGD's step: a layer whose state the checkpoint holds has taken one
            taken = [all((n, f) in self.entries for f in self.fields[key]) and bool(self.fields[key]) for n in layers]
            values = np.asarray(taken if key in self.dest.stacks else taken[0], like.dtype)
            return jax.device_put(values, like.sharding)
        present = {n: name for n in layers if (name := self.entries.get((n, field))) is not None}
        if not present:
            return like  # strict=False: it keeps the fresh values
        dtypes = dict.fromkeys(layers, getattr(torch, np.dtype(like.dtype).name))
        build = SliceBuilder(reader, present, dtypes)  # type: ignore[arg-type]  # a BoxReader reads as a Reader
        indices: list[Any] = list(like.sharding.addressable_devices_indices_map(tuple(like.shape)).values())
        stacked = key in self.dest.stacks
        for name in present.values():
            reader.plan(name, [i[1:] for i in indices] if stacked else indices)
        struct = jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=like.sharding)
        if stacked:
            return build.stacked(struct, [n if n in present else None for n in layers], layers[0], like)
        return build.array(struct, functools.partial(build.host, key, key))
