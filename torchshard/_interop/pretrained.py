"""load_safetensors: a Hugging Face safetensors checkpoint straight into shards, each process reading its own slices."""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy as copy_module
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchshard._base.errors import CheckpointError, raise_if_any
from torchshard._base.validate import instance_problems, raise_for_arguments
from torchshard._bridge.module_tensors import named_tensors, state_dict_names
from torchshard._bridge.tensors import host_array, is_jax_tensor, rebind, unwrap
from torchshard._ckpt.restore import (
    Destination,
    load_trainer,
    placed_destination,
    plan_destination,
    trainer_destination,
)
from torchshard._ckpt.state import Target, model_of, torch_dtypes
from torchshard._ckpt.stepdir import path_problems
from torchshard._interop.hf_conversion import convert
from torchshard._interop.renames import Rename, model_names, rename_problems
from torchshard._interop.safetensors_files import DTYPES, Reader, checkpoint_files, index_of, normalized
from torchshard._sharding.placement import assign, put, range_problems
from torchshard._sharding.plan import ShardingPlan
from torchshard._trainer.trainer import Trainer

_log = logging.getLogger("torchshard")
PathLike = str | os.PathLike[str]


def _check_args(path: Any, target: Any, plan: Any, rename: Any, strict: Any) -> None:
    problems = path_problems("path", path) + rename_problems(rename)
    problems += instance_problems("target", target, (Trainer, torch.nn.Module), "a Trainer or a torch.nn.Module")
    if plan is not None:
        problems += instance_problems("plan", plan, ShardingPlan, "a ShardingPlan from torchshard.plan()")
    if plan is not None and isinstance(target, Trainer):
        problems.append("plan= is for modules; a Trainer loads onto its own plan")
    problems += instance_problems("strict", strict, bool, "True or False")
    raise_for_arguments(problems, header="invalid load_safetensors() arguments")


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


def _problems(
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


class _Build:
    """Destination arrays built from this process's slices: each distinct slice read once, cast to the model's dtype."""

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


def _arrays(target: Target, dest: Destination, chosen: Mapping[str, str], build: _Build) -> dict[str, jax.Array]:
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


def _place(target: Target, dest: Destination, arrays: dict[str, jax.Array], plan: ShardingPlan | None) -> None:
    """Binds the loaded arrays, as `load` does; a Trainer's optimizer state and step start afresh."""
    model = model_of(target)
    if isinstance(target, Trainer):
        params = {k: arrays[k] for k in target.state.params}
        shardings = target.state_shardings()
        opt_state = jax.jit(target.optimizer.init, out_shardings=shardings.opt_state)(params)
        step = jax.device_put(np.int32(0), shardings.step)
        load_trainer(target, arrays, {"opt_state": opt_state, "step": step, "rng": target.rng_key})
    elif plan is not None:
        assign(model, arrays, plan)
    else:
        rebind(named_tensors(model), arrays)


def _destination(target: Target, plan: ShardingPlan | None) -> Destination:
    if isinstance(target, Trainer):
        return trainer_destination(target)
    return plan_destination(target, plan) if plan is not None else placed_destination(target)


def _read(
    root: pathlib.Path, target: Target, dest: Destination, *, rename: Rename | None, strict: bool
) -> dict[str, jax.Array]:
    """Every destination array, checked and read (this process's slices); nothing is bound yet."""
    model, dtypes = model_of(target), torch_dtypes(target)
    expected = state_dict_names(model)
    reader = Reader(checkpoint_files(root))
    index = index_of(root)
    unindexed = reader.restrict(index) if index is not None else []
    raise_if_any(unindexed, header=f"{root} does not match its index; save or download it", error=CheckpointError)
    conversion = convert(model, {n: s.shape for n, s in reader.tensors.items()}, set(expected))
    converted = conversion.problems + reader.convert(conversion.renamed, conversion.built)
    sources, problems = model_names(list(reader.tensors), rename)
    problems = converted + problems
    chosen, found = _problems(expected, dest, sources, reader, dtypes, strict=strict)
    header = f"checkpoint {root} does not fit {type(model).__name__}"
    raise_if_any(problems + found, header=f"{header}; pass rename= for other names, or the model it was saved from")
    kept = list(dict.fromkeys(dest.names[n] for n in expected if dest.names[n] not in chosen))
    if kept:  # strict=False: say which tensors were not in the checkpoint
        _log.info("load_safetensors: %d tensors not in %s keep the model's values: %s", len(kept), root, kept[:8])
    build = _Build(reader, sources, dtypes)
    arrays = _arrays(target, dest, chosen, build)
    raise_if_any(build.problems, header="checkpoint values JAX cannot hold")
    _log.info(
        "load_safetensors: this process read %d of the checkpoint's %d tensor bytes from %s",
        reader.requested,
        reader.total_bytes(),
        root,
    )
    return arrays


def load_safetensors(
    path: PathLike,
    target: Target,
    plan: ShardingPlan | None = None,
    *,
    rename: Rename | None = None,
    strict: bool = True,
) -> Target:
    """Loads a Hugging Face safetensors checkpoint into shards: the reverse of `save_safetensors`.

    ``path`` is a folder as ``save_pretrained``, `save_safetensors` or a Hub snapshot write it
    (``model.safetensors``, or shards with ``model.safetensors.index.json``) or one
    ``.safetensors`` file. Each process reads only the slices its own devices hold (safetensors'
    lazy ``get_slice``), each distinct slice once, so no process ever holds the whole model.
    Values take the model's dtypes as ``load_state_dict`` copies them (a bf16 checkpoint fills
    fp32 masters); a tied tensor is read once. Names are checked like a strict
    ``load_state_dict``: every missing, unexpected, mis-shaped and uncastable tensor at once, with
    near misses suggested, and nothing changes on error. A Trainer (scanned and pipelined stacks
    included) gets the weights with a fresh optimizer state and step 0. The bytes this process
    read are logged (``torchshard`` logger, INFO). A transformers model reads a checkpoint in the
    Hub's names through transformers' own conversion mapping, as ``from_pretrained`` does: MoE
    experts stored one by one fill the model's stacked expert tensors, each device reading only
    its experts' source tensors.

    Args:
        path: the checkpoint folder or file.
        target: a `Trainer`, a sharded module, or a module (``meta`` included) with ``plan``.
        plan: for a module not yet placed, the `ShardingPlan` to place it on.
        rename: maps each checkpoint name to the model's: a callable (None drops the tensor) or a
            list of ``(regex, replacement)`` pairs applied in order with ``re.sub``, e.g.
            ``[(r"^", "model.")]`` for a base model's checkpoint in a causal LM.
        strict: when False, missing tensors keep the model's values and unexpected ones are skipped.

    Returns:
        ``target``, now holding the checkpoint's values.

    Raises:
        ArgumentError: bad arguments, or a ``rename`` callable that raised (the name it was called with
            named, its exception the ``__cause__``); nothing is loaded.
        ShardingError: missing, unexpected, mis-shaped or uncastable tensors (all of them listed).
        CheckpointError: no such path, a folder without a checkpoint, a truncated or corrupted
            file, or an index naming a missing shard (each named).

    Examples:
        >>> import tempfile
        >>> source = torch.nn.Linear(16, 4)
        >>> folder = tempfile.mkdtemp()
        >>> _ = ts.save_safetensors(folder, ts.shard(source, ts.plan(source, ts.make_mesh({"data": 8}))))
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(16, 4)
        >>> p = ts.plan(model, ts.make_mesh({"data": 8}), [("weight", (None, "data"))])
        >>> model = load_safetensors(folder, model, p)
        >>> torch.equal(ts.to_torch_state_dict(model)["weight"], ts.to_torch_state_dict(source)["weight"])
        True
    """
    _check_args(path, target, plan, rename, strict)
    root = pathlib.Path(os.path.abspath(path))
    dest = _destination(target, plan)
    arrays = _read(root, target, dest, rename=rename, strict=strict)
    _place(target, dest, arrays, plan)
    return target
