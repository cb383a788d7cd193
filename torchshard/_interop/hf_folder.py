"""A ``save_pretrained`` folder as a causal LM sharded by ``hf_rules`` on a mesh: lm_eval's ``pretrained=``."""

from __future__ import annotations

import os
from typing import Any

import torch

from torchshard._base.errors import ArgumentError
from torchshard._interop.pretrained import load_safetensors
from torchshard._presets.hf import hf_rules
from torchshard._sharding.mesh import make_mesh, parse_axes, use_cpu_devices
from torchshard._trainer.staged_init import init_sharded

CPU_DEVICES = "TORCHSHARD_CPU_DEVICES"  # simulated CPU devices for a command line that cannot call use_cpu_devices


def mesh_axes(mesh: str | dict[str, int] | None) -> dict[str, int]:
    """``"data=4,model=2"`` (or a dict) as mesh axes; None: every device on "data".

    Examples:
        >>> mesh_axes("data=4,model=2"), mesh_axes(None)
        ({'data': 4, 'model': 2}, {'data': -1})
    """
    if mesh is None:
        return {"data": -1}
    if isinstance(mesh, dict):
        return mesh
    try:
        return parse_axes(str(mesh))
    except ArgumentError as err:
        raise ArgumentError(f"mesh={mesh!r}: {err}") from None


def cpu_devices_from_environment() -> None:
    """``TORCHSHARD_CPU_DEVICES=n`` simulates ``n`` CPU devices (JAX must not have started yet); unset: nothing.

    Raises:
        ArgumentError: the variable is set to anything but a positive int.
    """
    text = os.environ.get(CPU_DEVICES, "").strip()
    if not text:
        return
    if not (text.isdecimal() and int(text) > 0):
        raise ArgumentError(f"${CPU_DEVICES}={text!r} must be an int ≥ 1, e.g. 8, or unset")
    use_cpu_devices(int(text))


def load_causal_lm(path: str, mesh: str | dict[str, int] | None, pad_token: str | None) -> tuple[torch.nn.Module, Any]:
    """The folder's model built sharded by ``hf_rules`` on ``mesh`` and loaded, and the folder's tokenizer.

    Args:
        path: a folder written by ``save_pretrained`` (model and tokenizer).
        mesh: mesh axes (see `mesh_axes`); a "model" axis gets tensor parallelism, a "data" axis FSDP.
        pad_token: the pad token to give the tokenizer, or None to keep its own.

    Raises:
        ArgumentError: a mesh that is not axis=size pairs, or a path that is not a folder.
    """
    import transformers

    axes = mesh_axes(mesh)
    if not os.path.isdir(path):
        raise ArgumentError(
            f"pretrained={path!r} is not a folder: pass the folder save_pretrained wrote (a Hub model: download it "
            f"first, e.g. huggingface_hub.snapshot_download)"
        )
    cpu_devices_from_environment()
    config = transformers.AutoConfig.from_pretrained(path)
    build = lambda: transformers.AutoModelForCausalLM.from_config(config)  # noqa: E731
    with torch.device("meta"):
        rules = hf_rules(
            build(), axis="model" if "model" in axes else None, fsdp_axis="data" if "data" in axes else None
        )
    model = init_sharded(build, make_mesh(axes), rules)
    load_safetensors(path, model)  # in place
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if pad_token is not None:
        tokenizer.pad_token = pad_token
    return model, tokenizer
