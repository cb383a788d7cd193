"""What the loaders into shards share: argument checks, name matching, and arrays built from this process's slices."""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy as copy_module
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchshard._base.errors import CheckpointError, raise_if_any
from torchshard._base.validate import instance_problems, raise_for_arguments
from torchshard._bridge.module_tensors import named_tensors
from torchshard._bridge.tensors import host_array, is_jax_tensor, unwrap
from torchshard._ckpt.restore import Destination, bind_module, load_trainer
from torchshard._ckpt.state import Target, model_of
from torchshard._ckpt.stepdir import path_problems
from torchshard._interop.renames import rename_problems
from torchshard._interop.safetensors_files import DTYPES, Reader, normalized
from torchshard._sharding.placement import put, range_problems
from torchshard._sharding.plan import ShardingPlan
from torchshard._trainer.trainer import Trainer


def check_load_args(caller: str, path: Any, target: Any, plan: Any, rename: Any, strict: Any) -> None:
    """Every problem with a loader's arguments at once, as one `ArgumentError` naming ``caller`` (``load_dcp``)."""
    problems = path_problems("path", path) + rename_problems(rename)
    problems += instance_problems("target", target, (Trainer, torch.nn.Module), "a Trainer or a torch.nn.Module")
    if plan is not None:
        problems += instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    if plan is not None and isinstance(target, Trainer):
        problems.append("plan= is for modules; a Trainer loads onto its own plan")
    problems += instance_problems("strict", strict, bool, "True or False")
    raise_for_arguments(problems, header=f"invalid {caller}() arguments")


def _near(name: str, names: Sequence[str], sources: Mapping[str, str] | None = None) -> str:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {_shown(close[0], sources) if sources is not None else close[0]}?)"


def _shown(model_name: str, sources: Mapping[str, str]) -> str:
    stored = sources[model_name]
    return model_name if stored == model_name else f"{model_name} (stored as {stored})"


def _castable(stored: str, dtype: torch.dtype) -> str | None:
    """Why the checkpoint's dtype cannot become the model's, or None when it can."""
    held = DTYPES.get(stored)
    if held is None:
        return f"safetensors dtype {stored} has no torch dtype here"
    if held.is_complex and not dtype.is_complex:
        return f"{held} into {dtype} would drop the imaginary part"
    if (held.is_floating_point or held.is_complex) and not (dtype.is_floating_point or dtype.is_complex):
        return f"{held} into {dtype} would truncate the values"
    return None


def name_problems(
    expected: Sequence[str],
    dest: Destination,
    sources: Mapping[str, str],
    reader: Reader,
    dtypes: Mapping[str, Any],
    *,
    strict: bool,
) -> tuple[dict[str, str], list[str]]:
    """Canonical name → the model name to read it from, and every missing, unexpected, mis-shaped or uncastable one."""
    shapes = dest.layer_shapes()
    chosen: dict[str, str] = {}
    for name in expected:  # a tied tensor is read once, under the first of its names the checkpoint holds
        if name in sources:
            chosen.setdefault(dest.names[name], name)
    unexpected = [n for n in sources if n not in set(expected)]
    missing = [n for n in expected if dest.names[n] not in chosen and n == _first(n, expected, dest)]
    problems = []
    if strict:
        problems += [
            f"missing {n} {shapes[dest.names[n]]}: in the model, not in the checkpoint{_near(n, unexpected, sources)}"
            for n in missing
        ]
        problems += [
            f"unexpected {_shown(n, sources)} {reader.tensors[sources[n]].shape}: in the checkpoint, not in "
            f"the model{_near(n, missing)}"
            for n in unexpected
        ]
    for canon, name in chosen.items():
        stored = reader.tensors[sources[name]]
        if stored.shape != shapes[canon]:
            problems.append(f"mis-shaped {_shown(name, sources)}: checkpoint {stored.shape}, model {shapes[canon]}")
        elif (why := _castable(stored.dtype, dtypes[canon])) is not None:
            problems.append(f"uncastable {_shown(name, sources)} ({stored.file.name}): {why}")
    return chosen, problems


def _first(name: str, expected: Sequence[str], dest: Destination) -> str:
    canon = dest.names[name]
    return next(n for n in expected if dest.names[n] == canon)


class SliceBuilder:
    """Destination arrays from this process's slices: each distinct slice read once, cast to the model's dtype."""

    def __init__(self, reader: Reader, sources: Mapping[str, str], dtypes: Mapping[str, torch.dtype]) -> None:
        self.reader, self.sources, self.dtypes = reader, sources, dtypes
        self.problems: list[str] = []

    def host(self, name: str, canon: str, index: tuple[slice, ...]) -> np.ndarray:
        part = self.reader.read(self.sources[name], index)
        cast = part.to(self.dtypes[canon])  # as load_state_dict copies
        # a placed module holds int64 as int32: the stored values are checked, before the cast wraps them
        self.problems += range_problems(self.sources[name], cast if cast.is_floating_point() else part)
        return host_array(cast)

    def array(self, like: jax.ShapeDtypeStruct, read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
        shape = tuple(like.shape)
        done: dict[Any, np.ndarray] = {}

        def shard(index: Any) -> np.ndarray:  # devices holding the same slice share one read
            key = normalized(index, shape)
            if key not in done:
                done[key] = np.array(read(index), dtype=like.dtype)  # an own, aligned buffer: XLA takes it fast
            return done[key]

        # one call places every shard of this process (transfers batched), as `put` does
        array = jax.make_array_from_callback(shape, like.sharding, shard)
        self.reader.release()
        return array

    def stacked(self, like: jax.ShapeDtypeStruct, layers: Sequence[str | None], canon: str, own: Any) -> jax.Array:
        """A stack of layers (``None``: a layer the checkpoint lacks keeps ``own``'s values)."""
        if all(n is not None for n in layers):

            def read(index: tuple[slice, ...]) -> np.ndarray:
                picked = range(*index[0].indices(len(layers)))
                return np.stack([self.host(layers[i], canon, index[1:]) for i in picked])  # type: ignore[arg-type]

            return self.array(like, read)
        if own is None:
            raise CheckpointError(f"{canon}: no values to keep for the layers the checkpoint lacks")
        whole = tuple(slice(None) for _ in like.shape[1:])
        parts = [own[i] if n is None else self.host(n, canon, whole) for i, n in enumerate(layers)]
        return jax.jit(lambda p: jnp.stack(p), out_shardings=like.sharding)(parts)


def _computed_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Non-persistent buffers on meta that a transformers model's ``_init_weights`` computes (rotary frequencies,
    Gemma's ``embed_scale``).

    Each is computed on a copy of its module whose parameters and other buffers are on meta, so
    the model itself is untouched and the copy costs no memory whatever the module holds.
    """
    init = getattr(model, "_init_weights", None)
    found: dict[str, torch.Tensor] = {}
    if not callable(init):
        return found
    for prefix, module in model.named_modules():
        meta = {n: b for n, b in module._buffers.items() if b is not None and b.device.type == "meta"}
        floats = all(b.is_floating_point() for b in meta.values())
        if not meta or not floats or set(meta) - module._non_persistent_buffers_set:
            continue
        copy = _meta_copy(module)
        for name, buffer in meta.items():  # NaN until computed: a buffer init leaves alone is not taken
            copy._buffers[name] = torch.full(buffer.shape, torch.nan, dtype=buffer.dtype)
        with contextlib.suppress(Exception):  # a module init cannot compute stays without values (named later)
            init(copy)
        values = {n: v for n in meta if (v := copy._buffers[n]) is not None and not v.isnan().any()}
        found |= {f"{prefix}.{n}" if prefix else n: v for n, v in values.items()}
    return found


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose every parameter and buffer is a meta tensor of its shape and dtype."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(_on_meta(p), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = _on_meta(b)
    return copy_module(module, memo)


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")  # not empty_like: a jax tensor stays put


def _own_arrays(target: Target, model: torch.nn.Module, dest: Destination) -> dict[str, Any]:
    """Destination key → the values the target already holds (None for a tensor on meta)."""
    if isinstance(target, Trainer):
        return dict(target.physical_arrays())
    tensors = named_tensors(model)
    computed = _computed_buffers(model)
    own: dict[str, Any] = {}
    for key, like in dest.arrays.items():
        tensor = tensors[key]
        if is_jax_tensor(tensor):
            own[key] = unwrap(tensor)
        elif tensor.device.type != "meta":
            own[key] = put(tensor.detach(), like.sharding, what=key)
        elif key in computed:
            own[key] = put(computed[key].to(tensor.dtype), like.sharding, what=key)
        else:
            own[key] = None
    return own


def destination_arrays(
    target: Target, dest: Destination, chosen: Mapping[str, str], build: SliceBuilder
) -> dict[str, jax.Array]:
    """Every destination array: read from the checkpoint where ``chosen`` names it, else the target's own values.

    Raises:
        ShardingError: a tensor on the meta device that the checkpoint does not hold (no values to give it).
    """
    own = _own_arrays(target, model_of(target), dest)
    arrays: dict[str, jax.Array] = {}
    no_values = []
    for key, like in dest.arrays.items():
        layers = dest.stacks.get(key)
        if layers is not None:
            arrays[key] = build.stacked(like, [chosen.get(n) for n in layers], layers[0], own[key])
        elif key in chosen:
            arrays[key] = build.array(like, functools.partial(build.host, chosen[key], key))
        elif own[key] is not None:
            arrays[key] = own[key]
        else:
            no_values.append(f"{key} {tuple(like.shape)}: on the meta device and not in the checkpoint (no values)")
    raise_if_any(no_values, header="tensors with no values; build the model with init_sharded() instead of on meta")
    return arrays


def bind(target: Target, dest: Destination, arrays: dict[str, jax.Array], plan: ShardingPlan | None) -> None:
    """Binds the loaded arrays, as `load` does; a Trainer's optimizer state and step start afresh."""
    model = model_of(target)
    if isinstance(target, Trainer):
        params = {k: arrays[k] for k in target.state.params}
        shardings = target.state_shardings()
        opt_state = jax.jit(target.transform.init, out_shardings=shardings.opt_state)(params)
        step = jax.device_put(np.int32(0), shardings.step)
        load_trainer(target, arrays, {"opt_state": opt_state, "step": step, "rng": target.rng_key})
    else:
        bind_module(model, arrays, plan)
