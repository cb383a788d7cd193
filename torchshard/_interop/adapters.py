"""peft LoRA exports of a sharded model: the adapters alone in peft's format, or the base model with them merged."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
import torch

from torchshard._base.validate import int_problems, raise_for_arguments
from torchshard._bridge.env import env
from torchshard._bridge.module_tensors import canonical_names, state_dict_names
from torchshard._bridge.tensors import unwrap
from torchshard._ckpt.processes import together
from torchshard._ckpt.state import Target, export_arrays, model_of, target_problems, torch_dtypes
from torchshard._ckpt.stepdir import PathLike, path_problems
from torchshard._interop.export import torch_tensor
from torchshard._interop.safetensors import export_arrays_as, staged_write

_PEFT_PREFIX = "base_model.model."


def _check_args(path: Any, target: Any, merged: Any, max_shard_bytes: Any) -> torch.nn.Module:
    problems = path_problems("path", path) + int_problems("max_shard_bytes", max_shard_bytes, minimum=1)
    if not isinstance(merged, bool):  # a string such as "no" would count as true
        problems.append(f"merged must be True or False, got {type(merged).__name__} {merged!r:.40}")
    problems += target_problems(target)
    model = model_of(target) if not problems else None
    if model is not None and not (hasattr(model, "peft_config") and hasattr(model, "save_pretrained")):
        problems.append(
            f"target's model is a {type(model).__name__}, not a peft model; wrap it with peft.get_peft_model(model, "
            f"LoraConfig(...)) before sharding, or export it with save_safetensors()"
        )
    raise_for_arguments(problems, header="invalid save_adapters() arguments")
    assert model is not None
    return model


def _adapters(target: Target, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors (the adapters), gathered to CPU under their state_dict names."""
    arrays, dtypes, canonical = (
        export_arrays(target, doing="save_adapters()"),
        torch_dtypes(target),
        canonical_names(model),
    )
    trainable = [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    return {n: torch_tensor(arrays[canonical[n]], dtypes[canonical[n]], name=n) for n in trainable}


def _base_name(name: str) -> str:
    """A peft model's tensor name as the base model's: no ``base_model.model.`` prefix, no ``.base_layer``."""
    name = name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def _merged(target: Target, model: torch.nn.Module) -> tuple[dict[str, jax.Array], dict[str, torch.dtype]]:
    """The base model's tensors (by its own names) with each LoRA layer's delta added to its base weight (sharded)."""
    arrays, dtypes, canonical = (
        export_arrays(target, doing="save_adapters()"),
        torch_dtypes(target),
        canonical_names(model),
    )
    deltas: dict[str, jax.Array] = {}
    with env():  # peft's own delta (B @ A × scaling, transposed for fan_in_fan_out) on the sharded tensors
        for prefix, module in model.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "active_adapters"):
                for adapter in module.active_adapters:
                    name = f"{prefix}.base_layer.weight"
                    delta = unwrap(module.get_delta_weight(adapter))
                    deltas[name] = deltas[name] + delta if name in deltas else delta
    merged: dict[str, jax.Array] = {}
    kinds: dict[str, torch.dtype] = {}
    for name in dict.fromkeys(canonical[n] for n in state_dict_names(model)):
        if ".lora_" in name:
            continue
        value = arrays[name]
        if name in deltas:
            value = (value + deltas[name].astype(value.dtype)).astype(value.dtype)
        merged[_base_name(name)], kinds[_base_name(name)] = value, dtypes[name]
    return merged, kinds


def save_adapters(
    path: PathLike, target: Target, *, merged: bool = False, max_shard_bytes: int = 5 * 10**9
) -> pathlib.Path:
    """Exports a peft (LoRA) model's adapters in peft's own format, or the base model with them merged.

    The adapters alone: ``adapter_model.safetensors`` and ``adapter_config.json``, written by
    peft's own ``save_pretrained`` from the adapters gathered to CPU (only they are gathered), so
    ``PeftModel.from_pretrained(base_model, path)`` loads them. With ``merged=True``: every base
    tensor under the base model's names, each LoRA layer's ``B @ A × scaling`` added to its weight
    on the devices, written as `save_safetensors` writes a model (plus the base model's
    ``config.json``), so ``from_pretrained(path)`` loads the fine-tuned model without peft.
    Only process 0 writes; every process must call it. The export is atomic as `save_safetensors`'s
    is: written beside ``path`` and renamed into place, other files in ``path`` kept; on any
    failure ``path`` is as it was.

    Args:
        path: the output directory.
        target: a `Trainer` or a sharded module wrapping a peft model.
        merged: write the merged base model instead of the adapters.
        max_shard_bytes: with ``merged``, the most bytes per file.

    Returns:
        ``path/adapter_model.safetensors``, or the merged export's index file.

    Raises:
        ArgumentError: bad arguments, or a target that is not a peft model.
        CheckpointError: the files cannot be written (full disk, no permission); nothing is left behind.

    Examples:
        >>> import tempfile, peft
        >>> base = torch.nn.Sequential(torch.nn.Linear(16, 16))
        >>> model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"]))
        >>> _ = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
        >>> save_adapters(tempfile.mkdtemp(), model).name
        'adapter_model.safetensors'
    """
    model = _check_args(path, target, merged, max_shard_bytes)
    out = pathlib.Path(os.path.abspath(path))
    if merged:
        arrays, dtypes = _merged(target, model)
        config: Any = getattr(model, "config", None)
        also = config.save_pretrained if hasattr(config, "save_pretrained") else None
        return export_arrays_as(path, arrays, dtypes, max_shard_bytes=max_shard_bytes, also=also)
    state = _adapters(target, model)

    def write(staging: pathlib.Path | None) -> None:  # peft writes README.md first: into the staging folder too
        if staging is not None:
            model.save_pretrained(os.fspath(staging), state_dict=state, is_main_process=True)  # type: ignore[operator]

    together("torchshard-adapters-end", lambda: staged_write(out, write, replaced=lambda name: False))
    return pathlib.Path(path) / "adapter_model.safetensors"
