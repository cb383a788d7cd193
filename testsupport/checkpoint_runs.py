"""Shared runs and helpers of the checkpoint tests: trainers saved once per module, sharded modules, values."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest
import safetensors.torch
import torch
from torch import nn

import torchshard as ts
from testsupport.helpers import assert_close, to_numpy
from testsupport.models import TiedLM
from torchshard import presets

TP_LM = presets.tensor_parallel(colwise=[r"block\.up"], rowwise=[r"block\.down"])
TP_DROPOUT = presets.tensor_parallel(colwise=[r"0"], rowwise=[r"3"])


def dropout_mlp() -> nn.Module:
    """Dropout makes the loss depend on the per-step RNG key, so resuming must restore it."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.25), nn.Linear(64, 16))


def lm_loss(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def lm_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (16, 9), generator=g) for _ in range(n)]


def mlp_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)) for _ in range(n)]


@dataclasses.dataclass(frozen=True)
class Run:
    factory: Callable[[], nn.Module]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[], optax.GradientTransformation]
    rules: Any  # the source plan, on data=4 × model=2
    batches: Callable[[int], list[Any]]


RUNS = {
    "tiedlm_adamw": Run(TiedLM, lm_loss, lambda: optax.adamw(1e-2), TP_LM, lm_batches),
    "dropout_mlp_sgd": Run(dropout_mlp, mse, lambda: optax.sgd(0.05, momentum=0.9), TP_DROPOUT, mlp_batches),
}
DESTINATIONS = {
    "same_plan": (lambda: ts.make_mesh({"data": 4, "model": 2}), "source"),
    "fsdp_data8": (lambda: ts.make_mesh({"data": 8}), presets.fsdp(min_size=64)),
    "one_device": (lambda: ts.make_mesh({"data": 1}, devices=jax.devices()[:1]), None),
}


def make_trainer(run: Run, mesh, rules, *, torch_seed: int, seed: int) -> ts.Trainer:
    torch.manual_seed(torch_seed)
    model = run.factory()
    return ts.Trainer(model, run.loss_fn, run.optimizer(), ts.plan(model, mesh, rules), seed=seed)


def host_tree(tree):
    return jax.tree.map(np.asarray, tree)


@dataclasses.dataclass(frozen=True)
class Saved:
    path: pathlib.Path
    state: Any  # host copy of the TrainState at the save
    losses_after: list[float]  # steps 5..8 of the uninterrupted run


@pytest.mark.parametrize("destination", DESTINATIONS)
@pytest.mark.parametrize("run_name", RUNS)
def test_resume_gives_the_losses_of_an_uninterrupted_run(saved_run, run_name, destination):
    saved, run = saved_run(run_name), RUNS[run_name]
    mesh_fn, rules = DESTINATIONS[destination]
    trainer = make_trainer(run, mesh_fn(), run.rules if rules == "source" else rules, torch_seed=1, seed=1)
    assert ts.load(saved.path, trainer) is trainer
    assert trainer.step_count == 4
    losses = [float(trainer.step(b)["loss"]) for b in run.batches(8)[4:]]
    np.testing.assert_allclose(losses, saved.losses_after, rtol=1e-5)


@pytest.mark.parametrize("destination", ["fsdp_data8", "one_device"])
def test_load_restores_the_exact_state_onto_the_target_plan(saved_run, destination):
    saved = saved_run("tiedlm_adamw")
    mesh_fn, rules = DESTINATIONS[destination]
    trainer = make_trainer(RUNS["tiedlm_adamw"], mesh_fn(), rules, torch_seed=1, seed=1)
    ts.load(saved.path, trainer)
    jax.tree.map(np.testing.assert_array_equal, host_tree(trainer.state), saved.state)
    for name, array in {**trainer.state.params, **trainer.state.buffers}.items():
        assert array.sharding == trainer.plan[name], name
    for name, mu in trainer.state.opt_state[0].mu.items():
        assert mu.sharding == trainer.plan[name], name
    model = trainer.model
    assert model.head.weight is model.embed.weight
    assert_close(model.embed.weight, saved.state.params["embed.weight"], tol=0)


def sharded(factory: Callable[[], nn.Module], mesh, rules=None, *, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = factory()
    return ts.shard(model, ts.plan(model, mesh, rules))


def values(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: to_numpy(v) for k, v in model.state_dict().items()}


def data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """The shard files the processes wrote (``state/process_<i>.bin``), largest first."""
    files = list((step_dir / "state").glob("process_*.bin"))
    return sorted(files, key=lambda f: f.stat().st_size, reverse=True)


def read_safetensors(directory: pathlib.Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors |= safetensors.torch.load_file(directory / file)
    return index, tensors


class Cursor:
    """A tiny stateful sampler: a position and a torch.Generator, its state a dict holding a tensor and a tuple."""

    def __init__(self, seed: int = 0, seen: int = 0) -> None:
        self.generator, self.seen = torch.Generator().manual_seed(seed), seen

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "generator": self.generator.get_state(), "version": (1, 0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state["version"] == (1, 0)
        self.seen = state["seen"]
        self.generator.set_state(state["generator"])

    def next(self) -> list[int]:
        self.seen += 1
        return torch.randint(0, 1000, (4,), generator=self.generator).tolist()
