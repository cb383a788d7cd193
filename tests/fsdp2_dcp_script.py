"""FSDP2 on gloo CPU ranks, the DCP tests' torch side: ``torchrun --nproc-per-node W fsdp2_dcp_script.py MODE DIR``.

* ``save DIR``: trains the MLP of ``mp_torchrun_script.py`` (each block and the root ``fully_shard``) with torch
  AdamW for ``SAVED_AT`` steps, saves ``{"model": ..., "optimizer": ...}`` as ``get_state_dict`` gives them with
  ``dcp.save``, trains ``STEPS - SAVED_AT`` more steps; rank 0 writes ``DIR/fsdp2.json``: every loss and the
  full state dict at the save (model and AdamW state, as lists).
* ``load DIR``: a fresh FSDP2 model on this many ranks reads ``DIR`` with plain
  ``dcp.load({"model": model.state_dict()})``; rank 0 writes ``DIR/loaded.json``: the full state dict it got.
* ``resume DIR``: a fresh FSDP2 model and torch AdamW read ``DIR`` (model and optimizer, through ``get_state_dict``,
  ``dcp.load`` and ``set_state_dict``) and train steps ``SAVED_AT`` to ``STEPS``; rank 0 writes
  ``DIR/resumed.json``: their losses.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

STEPS, SAVED_AT, BATCH = 8, 4, 8


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:  # as mp_torchrun_script.batch
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def model() -> torch.nn.Module:  # as mp_torchrun_script.model, sharded by FSDP2
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    for layer in (net[0], net[2]):
        fully_shard(layer)
    return fully_shard(net)


def adamw(params) -> torch.optim.AdamW:
    """The optimizer of the FSDP2 runs (a Trainer given it resumes them)."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-8, weight_decay=1e-4)


def lists(state: dict) -> dict:
    """A (nested) state dict as JSON: tensors as nested lists."""
    if isinstance(state, dict):
        return {str(k): lists(v) for k, v in state.items()}
    return state.tolist() if isinstance(state, torch.Tensor) else state


def save(root: pathlib.Path) -> None:
    net = model()
    opt = adamw(net.parameters())
    losses, saved = [], {}
    rank = dist.get_rank()
    for step in range(STEPS):
        if step == SAVED_AT:
            model_state, optim_state = get_state_dict(net, opt)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(root))
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            saved = lists(dict(zip(("model", "optimizer"), get_state_dict(net, opt, options=full), strict=True)))
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(net(x), y)  # every rank the whole batch: FSDP2 averages equal grads
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if rank == 0:
        (root / "fsdp2.json").write_text(json.dumps({"losses": losses, "saved": saved}))


def load(root: pathlib.Path) -> None:
    net = model()
    state = {"model": net.state_dict()}  # get_state_dict's layout, as save_dcp writes it
    dcp.load(state, checkpoint_id=str(root))  # into the DTensors in place
    net.load_state_dict(state["model"])
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        (root / "loaded.json").write_text(json.dumps(lists(full)))


def resume(root: pathlib.Path) -> None:
    net = model()
    opt = adamw(net.parameters())
    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(root))
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    losses = []
    for step in range(SAVED_AT, STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if dist.get_rank() == 0:
        (root / "resumed.json").write_text(json.dumps({"losses": losses}))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    {"save": save, "load": load, "resume": resume}[sys.argv[1]](pathlib.Path(sys.argv[2]))
    dist.destroy_process_group()
