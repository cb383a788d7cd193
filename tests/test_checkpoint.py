"""Checkpoints: exact resume across meshes and plans, atomic saves, strict and corrupt loads, torch export."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import safetensors.torch
import torch
from helpers import assert_close, to_numpy
from models import MLP, TiedLM
from torch import nn

import torchshard as ts
from torchshard import _checkpoint, _ckpt_meta, _stepdir, presets

TESTS = pathlib.Path(__file__).parent
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


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Trains 4 steps, saves, trains 4 more without stopping (the reference); cached per run."""
    cache: dict[str, Saved] = {}

    def get(name: str) -> Saved:
        if name not in cache:
            run = RUNS[name]
            trainer = make_trainer(run, ts.make_mesh({"data": 4, "model": 2}), run.rules, torch_seed=0, seed=0)
            batches = run.batches(8)
            for b in batches[:4]:
                trainer.step(b)
            path = tmp_path_factory.mktemp(name)
            ts.save(path, trainer)
            state = host_tree(trainer.state)
            cache[name] = Saved(path, state, [float(trainer.step(b)["loss"]) for b in batches[4:]])
        return cache[name]

    return get


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


def test_a_module_saves_and_loads_onto_its_current_shardings(tmp_path, mesh_dm, mesh_fsdp):
    source = sharded(TiedLM, mesh_dm, TP_LM)
    target = sharded(TiedLM, mesh_fsdp, presets.fsdp(min_size=64), seed=1)
    shardings = {n: t.jax().sharding for n, t in target.state_dict(keep_vars=True).items()}
    assert ts.save(tmp_path, source) == tmp_path / "step_00000000"
    ts.load(tmp_path, target)
    jax.tree.map(np.testing.assert_array_equal, values(target), values(source))
    assert {n: t.jax().sharding for n, t in target.state_dict(keep_vars=True).items()} == shardings
    assert target.head.weight is target.embed.weight


def test_a_trainer_checkpoint_loads_into_a_meta_module_with_a_plan(saved_run, mesh_fsdp):
    saved = saved_run("tiedlm_adamw")
    with torch.device("meta"):
        model = TiedLM()
    p = ts.plan(model, mesh_fsdp, presets.fsdp(min_size=64))
    ts.load(saved.path, model, plan=p)
    assert model.embed.weight.jax().sharding == p["embed.weight"]
    assert model.head.weight is model.embed.weight
    assert_close(model.block.up.weight, saved.state.params["block.up.weight"], tol=0)


@pytest.mark.parametrize(
    ("target", "lines"),
    [
        (
            lambda: MLP((32, 64, 16)),
            [
                r"mis-shaped layers\.1\.weight: checkpoint \(64, 64\), model \(16, 64\)",
                r"mis-shaped layers\.1\.bias: checkpoint \(64,\), model \(16,\)",
                r"unexpected layers\.2\.weight \(16, 64\): in the checkpoint, not in the model",
                r"unexpected layers\.2\.bias \(16,\)",
            ],
        ),
        (
            lambda: MLP((32, 64, 64, 64, 16)),
            [
                r"mis-shaped layers\.2\.weight: checkpoint \(16, 64\), model \(64, 64\)",
                r"mis-shaped layers\.2\.bias: checkpoint \(16,\), model \(64,\)",
                r"missing layers\.3\.weight \(16, 64\): in the model, not in the checkpoint",
                r"missing layers\.3\.bias \(16,\)",
            ],
        ),
    ],
    ids=["fewer_layers", "more_layers"],
)
def test_a_mismatched_model_lists_every_missing_unexpected_and_misshaped_tensor(tmp_path, mesh_dm, target, lines):
    ts.save(tmp_path, sharded(MLP, mesh_dm))
    with pytest.raises(
        ts.ShardingError, match=r"\(MLP\) does not fit MLP; load it into the architecture .* \(\d+ problems\)"
    ) as info:
        ts.load(tmp_path, sharded(target, mesh_dm))
    for line in lines:
        assert len(re.findall(line, str(info.value))) == 1, (line, str(info.value))
    assert len(info.value.problems) == len(lines)


def untied_lm() -> nn.Module:
    model = TiedLM()
    model.head.weight = nn.Parameter(model.embed.weight.detach() + 1.0)
    return model


def test_a_checkpoint_tied_tensor_loads_into_an_untied_model_as_separate_copies(tmp_path, mesh_dm):
    source = sharded(TiedLM, mesh_dm, TP_LM)
    ts.save(tmp_path, source)
    target = ts.load(tmp_path, sharded(untied_lm, mesh_dm, TP_LM, seed=1))
    assert target.head.weight is not target.embed.weight
    assert target.head.weight.jax() is not target.embed.weight.jax()
    assert_close(target.head.weight, source.embed.weight, tol=0)


def test_a_model_tie_over_different_checkpoint_values_is_a_mismatch(tmp_path, mesh_dm):
    ts.save(tmp_path, sharded(untied_lm, mesh_dm, TP_LM))
    with pytest.raises(
        ts.ShardingError, match=r"tied head\.weight = embed\.weight: one tensor in the model, different"
    ):
        ts.load(tmp_path, sharded(TiedLM, mesh_dm, TP_LM))


def test_a_different_optimizer_is_a_mismatch(saved_run, mesh_dm):
    saved = saved_run("dropout_mlp_sgd")
    run = dataclasses.replace(RUNS["dropout_mlp_sgd"], optimizer=lambda: optax.adam(1e-3))
    trainer = make_trainer(run, mesh_dm, TP_DROPOUT, torch_seed=0, seed=0)
    with pytest.raises(
        ts.ShardingError, match=r"missing optimizer/step leaf \['opt_state'\]\[0\]\.mu\['0\.weight'\] \(64, 32\)"
    ):
        ts.load(saved.path, trainer)


def test_a_module_checkpoint_does_not_load_into_a_trainer(tmp_path, mesh_dm):
    ts.save(tmp_path, sharded(MLP, mesh_dm))
    run = Run(MLP, mse, lambda: optax.sgd(0.1), None, mlp_batches)
    with pytest.raises(ts.ShardingError, match=r"no optimizer state or step \(it was saved from a module\)"):
        ts.load(tmp_path, make_trainer(run, mesh_dm, None, torch_seed=0, seed=0))


def data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """The tensorstore chunk files orbax wrote, largest first."""
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    return sorted(files, key=lambda f: f.stat().st_size, reverse=True)


def flip_bytes(f: pathlib.Path) -> None:
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0x5A
    f.write_bytes(bytes(data))


def edit_meta(step_dir: pathlib.Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrites torchshard.json as valid JSON with ``edit`` applied (as a hand edit or a bit flip would)."""
    meta = json.loads((step_dir / "torchshard.json").read_text())
    (step_dir / "torchshard.json").write_text(json.dumps(edit(meta) or meta))


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(meta: dict[str, Any]) -> None:
        leaf = meta
        for key in path[:-1]:
            leaf = leaf[key]
        leaf[path[-1]] = value

    return edit


DAMAGE = {
    "flipped_bytes": (
        lambda d: flip_bytes(data_files(d)[0]),
        r"(?s)is corrupted; load an earlier step \(1 problem\).*layers\.\d\.weight: checksum mismatch",
    ),
    "truncated_data": (
        lambda d: data_files(d)[0].write_bytes(data_files(d)[0].read_bytes()[:100]),
        r"(?s)is incomplete or truncated; load an earlier step \(1 problem\).*state/.*/d/\w+: 100 bytes, saved \d+",
    ),
    "deleted_data": (lambda d: data_files(d)[0].unlink(), r"(?s)incomplete or truncated.*state/.*/d/\w+: missing"),
    "garbled_orbax_metadata": (
        lambda d: (d / "state" / "_METADATA").write_bytes(b"x" * (d / "state" / "_METADATA").stat().st_size),
        r"array data could not be read \(.*\); the checkpoint is truncated or corrupted; load an earlier step",
    ),
    "garbled_metadata": (
        lambda d: (d / "torchshard.json").write_text('{"format": "torchshard-checkpoint", "vers'),
        r"torchshard\.json is unreadable or malformed \(JSONDecodeError",
    ),
    "foreign_metadata": (
        lambda d: (d / "torchshard.json").write_text("{}"),
        r"(?s)malformed.*format None",
    ),
    "metadata_is_a_list": (
        lambda d: (d / "torchshard.json").write_text("[1]"),
        r"(?s)malformed.*a list, not an object",
    ),
    "edited_shape": (
        lambda d: edit_meta(d, _set(("tensors", "layers.0.weight", "shape"), [3, 3])),
        r"(?s)torchshard\.json is unreadable or malformed; .* \(1 problem\):\n  - its digest does not match",
    ),
    "bad_dtype_and_shape": (
        lambda d: edit_meta(d, _set(("tensors", "layers.0.bias"), {"shape": "64", "dtype": "float99"})),
        r"(?s)\(2 problems\).*tensors 'layers\.0\.bias': .* is not a shape, dtype and checksum.*digest does not",
    ),
    "name_of_no_tensor": (
        lambda d: edit_meta(d, _set(("names", "layers.0.weight"), "nope")),
        r"(?s)names 'layers\.0\.weight' → 'nope': no such stored tensor",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_raises_a_clear_error_naming_the_file(tmp_path, mesh_dm, damage):
    model = sharded(lambda: MLP((32, 256, 16)), mesh_dm)
    step_dir = ts.save(tmp_path, model)
    corrupt, match = DAMAGE[damage]
    corrupt(step_dir)
    with pytest.raises(ts.CheckpointError, match=match):
        ts.load(step_dir, model)


def test_a_version_1_checkpoint_without_a_digest_still_loads(tmp_path, mesh_dm):
    model = sharded(MLP, mesh_dm)
    step_dir = ts.save(tmp_path, model)
    edit_meta(step_dir, lambda meta: {k: v for k, v in meta.items() if k != "digest"} | {"version": 1})
    jax.tree.map(np.testing.assert_array_equal, values(ts.load(tmp_path, sharded(MLP, mesh_dm, seed=1))), values(model))


@pytest.mark.parametrize("damage", ["truncated_data", "deleted_data", "garbled_metadata", "foreign_metadata"])
def test_an_incomplete_newest_step_is_not_listed_and_the_previous_one_loads(tmp_path, mesh_dm, damage, caplog):
    older, newer = sharded(lambda: MLP((32, 256, 16)), mesh_dm), sharded(lambda: MLP((32, 256, 16)), mesh_dm, seed=1)
    ts.save(tmp_path, older, step=1)
    DAMAGE[damage][0](ts.save(tmp_path, newer, step=2))
    assert ts.checkpoint_steps(tmp_path) == [1]
    target = sharded(lambda: MLP((32, 256, 16)), mesh_dm, seed=2)
    jax.tree.map(np.testing.assert_array_equal, values(ts.load(tmp_path, target)), values(older))
    assert "loading step 1; newer step directories are incomplete: step_00000002: " in caplog.text
    with pytest.raises(ts.CheckpointError, match=r"no complete checkpoint for step 2 under .*\(.*\); available steps"):
        ts.load(tmp_path, target, step=2)


class Interrupted(KeyboardInterrupt):
    pass


def _raise(*_: Any, **__: Any) -> None:
    raise Interrupted


def after(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run_then_raise(*args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)
        raise Interrupted

    return run_then_raise


INTERRUPTIONS = {  # where a save dies: (object, attribute, replacement)
    "inside_orbax": (ocp.PyTreeCheckpointHandler, "save", _raise),
    "after_arrays": (_checkpoint, "write_state", after(_checkpoint.write_state)),
    "after_metadata": (_checkpoint, "write_meta", after(_checkpoint.write_meta)),
    "at_rename": (_checkpoint, "commit", _raise),
}


@pytest.mark.parametrize("where", INTERRUPTIONS)
def test_an_interrupted_save_never_loads_and_is_cleaned_up(tmp_path, mesh_dm, monkeypatch, where):
    model = sharded(MLP, mesh_dm)
    ts.save(tmp_path, model, step=4)
    before = values(model)
    with monkeypatch.context() as m:
        m.setattr(*INTERRUPTIONS[where])
        with pytest.raises(Interrupted):
            ts.save(tmp_path, sharded(MLP, mesh_dm, seed=2), step=8)
    assert ts.checkpoint_steps(tmp_path) == [4]
    target = sharded(MLP, mesh_dm, seed=3)
    jax.tree.map(np.testing.assert_array_equal, values(ts.load(tmp_path, target)), before)
    with pytest.raises(ts.CheckpointError, match=r"no complete checkpoint for step 8 .* available steps: \[4\]"):
        ts.load(tmp_path, target, step=8)
    ts.save(tmp_path, model, step=9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000009"]


def test_keep_last_retains_the_newest_steps_and_load_picks_the_latest(tmp_path, mesh_dm):
    models = [sharded(MLP, mesh_dm, seed=s) for s in range(3)]
    for step in range(1, 6):
        ts.save(tmp_path, models[step % 3], step=step, keep_last=2)
    assert ts.checkpoint_steps(tmp_path) == [4, 5]
    ts.save(tmp_path, models[0], step=2, keep_last=2)  # an older step just saved is kept
    assert ts.checkpoint_steps(tmp_path) == [2, 5]
    ts.save(tmp_path, models[0], step=5)  # saving an existing step replaces it
    target = sharded(MLP, mesh_dm, seed=9)
    jax.tree.map(np.testing.assert_array_equal, values(ts.load(tmp_path, target)), values(models[0]))
    ts.load(tmp_path / "step_00000002", target)
    jax.tree.map(np.testing.assert_array_equal, values(target), values(models[0]))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda p, m: ts.load(p / "nowhere", m), ts.CheckpointError, r"nowhere: the directory does not exist"),
        (
            lambda p, m: ts.load(p, m),
            ts.CheckpointError,
            r"(?s)no complete checkpoint at .* \(1 problem\):\n  - no step_<N>/torchshard\.json inside",
        ),
        (lambda p, m: ts.load(p, m, step=-1), ts.ShardingError, r"step=-1 must be an int ≥ 0 or None \(the latest\)"),
        (lambda p, m: ts.load(p, m, plan="fsdp"), ts.ShardingError, r"plan must be a ShardingPlan"),
        (
            lambda p, m: ts.load(ts.save(p, m), MLP()),
            ts.ShardingError,
            r"layers\.0\.weight \(64, 32\): a plain torch tensor on cpu",
        ),
        (
            lambda p, m: ts.save(p, m, keep_last=0),
            ts.ShardingError,
            r"keep_last=0 must be an int ≥ 1 or None \(keep every step\)",
        ),
        (lambda p, m: ts.save(p, m, step=1.5), ts.ShardingError, r"step=1\.5 must be an int ≥ 0 or None"),
        (lambda p, m: ts.save(p, {"w": m}), ts.ShardingError, r"target must be a Trainer or a sharded .* got dict"),
        (lambda p, m: ts.save(p, MLP()), ts.ShardingError, r"save\(\): MLP is not sharded; place it with"),
        (lambda p, m: ts.to_torch_state_dict(MLP()), ts.ShardingError, r"to_torch_state_dict\(\): MLP is not sharded"),
        (
            lambda p, m: ts.save_safetensors(p, m, max_shard_bytes=0),
            ts.ShardingError,
            r"max_shard_bytes=0 must be an int ≥ 1",
        ),
    ],
    ids=[
        "missing_dir",
        "empty_dir",
        "negative_step",
        "bad_plan",
        "unplaced_target",
        "keep_last_0",
        "float_step",
        "not_a_module",
        "unplaced_save",
        "unplaced_export",
        "bad_shard_bytes",
    ],
)
def test_bad_calls_raise(tmp_path, mesh_dm, call, error, match):
    with pytest.raises(error, match=match):
        call(tmp_path, sharded(MLP, mesh_dm))


def test_plan_with_a_trainer_is_an_error(saved_run, mesh_dm):
    run = RUNS["dropout_mlp_sgd"]
    trainer = make_trainer(run, mesh_dm, None, torch_seed=0, seed=0)
    with pytest.raises(ts.ShardingError, match=r"plan= is for modules; a Trainer loads onto its own plan"):
        ts.load(saved_run("dropout_mlp_sgd").path, trainer, plan=trainer.plan)


def test_to_torch_state_dict_is_plain_torch_with_ties_and_dtypes(mesh_dm):
    torch.manual_seed(0)
    reference = nn.Sequential(TiedLM(), nn.BatchNorm1d(64))  # BatchNorm adds an int64 buffer
    model = copy.deepcopy(reference)
    run = Run(lambda: model, lambda m, b: m[0](b).sum(), lambda: optax.sgd(0.0), None, lm_batches)
    trainer = make_trainer(run, mesh_dm, presets.fsdp(min_size=64), torch_seed=0, seed=0)
    state = ts.to_torch_state_dict(trainer)
    expected = reference.state_dict()
    assert list(state) == list(expected)
    for name, tensor in state.items():
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu", name
        assert tensor.dtype == expected[name].dtype, name
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    assert state["0.head.weight"] is state["0.embed.weight"]


SUBPROCESS = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from models import TiedLM
torch.manual_seed(123)
model = TiedLM()
model.load_state_dict(torch.load(sys.argv[2]))
assert model.head.weight is model.embed.weight
torch.save(model(torch.load(sys.argv[3])).detach(), sys.argv[4])
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "torchax", "torchshard"))
assert not leaked, leaked
"""


def test_exported_state_dict_loads_in_a_process_without_jax(tmp_path, mesh_dm):
    torch.manual_seed(0)
    reference = TiedLM()
    model = ts.shard(copy.deepcopy(reference), ts.plan(copy.deepcopy(reference), mesh_dm, TP_LM))
    ids = lm_batches(1)[0][:, :-1]
    torch.save(ts.to_torch_state_dict(model), tmp_path / "model.pt")
    torch.save(ids, tmp_path / "ids.pt")
    files = [str(TESTS), *(str(tmp_path / f) for f in ("model.pt", "ids.pt", "out.pt"))]
    done = subprocess.run([sys.executable, "-c", SUBPROCESS, *files], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), reference(ids), rtol=0, atol=0)


def test_from_torch_state_dict_places_a_plain_state_dict_onto_a_plan(mesh_fsdp):
    torch.manual_seed(0)
    reference = TiedLM()
    with torch.device("meta"):
        model = TiedLM()
    p = ts.plan(model, mesh_fsdp, presets.fsdp(min_size=64))
    assert ts.from_torch_state_dict(model, reference.state_dict(), p) is model
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.jax().sharding == p["embed.weight"]
    jax.tree.map(np.testing.assert_array_equal, values(model), values(reference))


def test_from_torch_state_dict_lists_every_problem(mesh_fsdp):
    state = TiedLM().state_dict()
    del state["norm.bias"]
    state["block.up.weight"] = torch.zeros(3, 3)
    state["extra"] = torch.zeros(2)
    model = TiedLM()
    with pytest.raises(
        ts.ShardingError, match=r"state_dict does not fit TiedLM; load it into the model it came from \(3 problems\)"
    ) as info:
        ts.from_torch_state_dict(model, state, ts.plan(model, mesh_fsdp))
    assert info.value.problems == (
        "missing norm.bias (32,): in the model, not in the state_dict",
        "unexpected extra (2,): in the state_dict, not in the model",
        "mis-shaped block.up.weight: state_dict (3, 3), model (64, 32)",
    )


def read_safetensors(directory: pathlib.Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors |= safetensors.torch.load_file(directory / file)
    return index, tensors


def test_save_safetensors_writes_hf_style_shards_with_ties_stored_once(tmp_path, mesh_dm):
    model = sharded(TiedLM, mesh_dm, TP_LM)
    (tmp_path / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    assert ts.save_safetensors(tmp_path, model, max_shard_bytes=9000) == tmp_path / "model.safetensors.index.json"
    index, tensors = read_safetensors(tmp_path)
    state = ts.to_torch_state_dict(model)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert set(tensors) == set(index["weight_map"]) == set(state) - {"head.weight"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    fresh = TiedLM()
    assert fresh.load_state_dict(tensors, strict=False).missing_keys == ["head.weight"]
    torch.testing.assert_close(fresh.head.weight, state["head.weight"], rtol=0, atol=0)


# --- crash consistency: a kill at every filesystem step of save, re-save, prune and recovery ----------


class Killed(BaseException):
    """A simulated SIGKILL: no handler catches it and nothing after it runs."""


class Faults:
    """Counts every filesystem step a save takes (renames, deletions, writes) and kills it at step ``at``."""

    def __init__(self, at: int) -> None:
        self.at, self.steps = at, []

    def step(self, what: str) -> None:
        self.steps.append(what)
        if len(self.steps) == self.at:
            raise Killed(what)

    def counting(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            path = next((a for a in args if isinstance(a, str | os.PathLike)), "")
            self.step(f"{name} {pathlib.Path(path).name}")
            return fn(*args, **kwargs)

        return run

    def rmtree(self, path: Any) -> None:
        """Deletes like shutil.rmtree, killable before it starts and after its first file (half-deleted)."""
        self.step(f"rmtree {pathlib.Path(path).name}")
        first = next((f for f in sorted(pathlib.Path(path).rglob("*")) if f.is_file()), None)
        if first is not None:
            first.unlink()
            self.step(f"rmtree {pathlib.Path(path).name} (one file deleted)")
        shutil.rmtree(path)

    def write_meta(self, directory: pathlib.Path, meta: dict[str, Any]) -> None:
        """Killable before the commit marker is written and after half of it (a torn write)."""
        self.step("write torchshard.json")
        (directory / "torchshard.json").write_text(json.dumps(meta)[:50])
        self.step("write torchshard.json (torn)")
        _ckpt_meta.write_meta(directory, meta)


class _Namespace:
    """A module whose named functions are replaced; everything else is the real module's."""

    def __init__(self, real: Any, **replaced: Callable[..., Any]) -> None:
        self.__dict__.update(replaced, _real=real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def inject(monkeypatch, faults: Faults) -> None:
    fake_os = _Namespace(
        os, **{n: faults.counting(n, getattr(os, n)) for n in ("replace", "unlink", "mkdir", "makedirs")}
    )
    monkeypatch.setattr(_stepdir, "os", fake_os)
    monkeypatch.setattr(_stepdir, "shutil", _Namespace(shutil, rmtree=faults.rmtree))
    monkeypatch.setattr(_checkpoint, "write_state", faults.counting("write_state", _checkpoint.write_state))
    monkeypatch.setattr(_checkpoint, "write_meta", faults.write_meta)


TINY = lambda: nn.Linear(4, 2)  # noqa: E731  # few files: every step of the protocol stays cheap to kill at
OLD, TMP, TRASH = _stepdir.OLD, _stepdir.TMP, _stepdir.TRASH


@dataclasses.dataclass(frozen=True)
class Scenario:
    before: dict[str, int]  # entry name → which template model's complete step it copies (-1: with a file missing)
    save: tuple[int, int | None]  # the step saved (by model "new") and keep_last
    must_list: dict[int, set[str]]  # steps that are always listed → the models they may hold
    may_list: dict[int, set[str]]  # steps that may be listed → the models they may hold
    final: list[int]  # the listing when the save is not killed


N = {s: _stepdir.step_name(s) for s in range(5)}
SCENARIOS = {
    "save": Scenario({N[1]: 1, N[2]: 2}, (3, None), {1: {"1"}, 2: {"2"}}, {3: {"new"}}, [1, 2, 3]),
    "resave": Scenario({N[1]: 1, N[2]: 2}, (2, None), {1: {"1"}, 2: {"2", "new"}}, {}, [1, 2]),
    "prune": Scenario({N[1]: 1, N[2]: 2, N[3]: 3}, (4, 2), {3: {"3"}}, {1: {"1"}, 2: {"2"}, 4: {"new"}}, [3, 4]),
    "resave_and_prune": Scenario({N[1]: 1, N[2]: 2, N[3]: 3}, (3, 2), {3: {"3", "new"}}, {1: {"1"}, 2: {"2"}}, [2, 3]),
    "recovery_of_a_crash": Scenario(
        {N[1]: 1, OLD + N[2]: 2, TMP + N[3]: -1, TRASH + N[0]: -1},
        (4, 2),
        {2: {"2"}},
        {1: {"1"}, 4: {"new"}},
        [2, 4],
    ),
}


@pytest.fixture(scope="module")
def templates(tmp_path_factory, mesh_dm_module):
    """Complete step directories of tiny models "1", "2", "3" (copied, never saved again) and the models."""
    root = tmp_path_factory.mktemp("templates")
    models = {str(i): sharded(TINY, mesh_dm_module, seed=i) for i in (1, 2, 3)} | {
        "new": sharded(TINY, mesh_dm_module, seed=7),
        "next": sharded(TINY, mesh_dm_module, seed=8),
    }
    for i in (1, 2, 3):
        ts.save(root, models[str(i)], step=i)
    return root, models


@pytest.fixture(scope="module")
def mesh_dm_module():
    return ts.make_mesh({"data": 4, "model": 2})


def _copy_before(root: pathlib.Path, templates: pathlib.Path, before: dict[str, int]) -> None:
    for name, model in before.items():
        shutil.copytree(templates / _stepdir.step_name(abs(model)), root / name)
        if model < 0:
            data_files(root / name)[0].unlink()


def _held_model(root: pathlib.Path, step: int, models: dict[str, nn.Module], probe: nn.Module) -> str:
    """Which model a listed step holds (it must load, and hold one of them exactly)."""
    got = values(ts.load(root, probe, step=step))
    same = [k for k, m in models.items() if all(np.array_equal(got[n], v) for n, v in values(m).items())]
    assert len(same) == 1, (step, same)
    return same[0]


def _check_listing(root: pathlib.Path, scenario: Scenario, models, probe, where: str) -> list[int]:
    listed = ts.checkpoint_steps(root)
    for step in scenario.must_list:
        assert step in listed, f"killed at {where}: step {step} vanished ({listed})"
    for step in listed:
        allowed = scenario.must_list.get(step) or scenario.may_list.get(step)
        assert allowed is not None, f"killed at {where}: step {step} listed ({listed})"
        assert _held_model(root, step, models, probe) in allowed, (where, step)
    return listed


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_kill_at_any_filesystem_step_leaves_only_complete_listed_steps(
    tmp_path, monkeypatch, templates, mesh_dm_module, name
):
    """Kills the save at its 1st, 2nd, ... filesystem step until one runs through; checks every outcome."""
    template_root, models = templates
    scenario, probe = SCENARIOS[name], sharded(TINY, mesh_dm_module, seed=9)
    step, keep_last = scenario.save
    for at in range(1, 100):
        root = tmp_path / f"kill_at_{at}"
        _copy_before(root, template_root, scenario.before)
        faults = Faults(at)
        with monkeypatch.context() as m:
            inject(m, faults)
            with contextlib.suppress(Killed):
                ts.save(root, models["new"], step=step, keep_last=keep_last)
        where = faults.steps[-1] if len(faults.steps) >= at else "nowhere (not killed)"
        listed = _check_listing(root, scenario, models, probe, where)
        ts.save(root, models["next"], step=9)  # the next save recovers and works
        assert ts.checkpoint_steps(root) == sorted({*listed, 9}), where
        assert all(p.name.startswith("step_") for p in root.iterdir()), (where, sorted(root.iterdir()))
        assert _held_model(root, 9, models, probe) == "next"
        if len(faults.steps) < at:  # ran through: every step before was a kill point
            assert listed == scenario.final
            break
    else:
        raise AssertionError(f"the save was still being killed after 99 steps: {faults.steps}")
    assert at > 5, faults.steps  # a save takes several steps: each was killed once


# --- full disks, read-only mounts, files in the way ----------------------------------------------


def enospc(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def orbax_full(*_: Any, **__: Any) -> None:
    raise ValueError(
        "RESOURCE_EXHAUSTED: Error writing \"w/0.0\": Failed to write: No space left on device [os_error_code='28']"
    )


def read_only(*_: Any, **__: Any) -> None:
    raise OSError(errno.EROFS, "Read-only file system")


OS_FAULTS = {  # (object, attribute, replacement, message)
    "disk_full": (_checkpoint, "write_state", enospc, r"the disk is full \(No space left on device\)"),
    "disk_full_in_orbax": (ocp.PyTreeCheckpointHandler, "save", orbax_full, r"the disk is full \(RESOURCE_EXHAUSTED"),
    "disk_full_writing_metadata": (_checkpoint, "write_meta", enospc, r"the disk is full"),
    "read_only_mount": (_stepdir.os, "mkdir", read_only, r": not writable \(Read-only file system\)"),
}


@pytest.mark.parametrize("fault", OS_FAULTS)
def test_os_errors_during_save_are_checkpoint_errors_and_leave_earlier_steps(tmp_path, mesh_dm, monkeypatch, fault):
    model = sharded(MLP, mesh_dm)
    ts.save(tmp_path, model, step=1)
    obj, attribute, replacement, match = OS_FAULTS[fault]
    with monkeypatch.context() as m:
        m.setattr(obj, attribute, replacement)
        with pytest.raises(ts.CheckpointError, match=match) as info:
            ts.save(tmp_path, sharded(MLP, mesh_dm, seed=1), step=2)
    assert str(tmp_path) in str(info.value)
    assert str(info.value).endswith(("then save again", "(not a read-only mount)"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # the partial save is gone
    jax.tree.map(np.testing.assert_array_equal, values(ts.load(tmp_path, sharded(MLP, mesh_dm, seed=2))), values(model))


@pytest.mark.parametrize(
    ("path", "match"),
    [
        (lambda p: p / "afile", r"afile: a file is in the way \(File exists\); nothing was written"),
        (lambda p: p / "afile" / "ckpt", r"afile/ckpt: a file is in the way \(Not a directory\)"),
    ],
    ids=["path_is_a_file", "parent_is_a_file"],
)
def test_saving_onto_a_file_is_a_checkpoint_error(tmp_path, mesh_dm, path, match):
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(ts.CheckpointError, match=match + r".*pass a directory path"):
        ts.save(path(tmp_path), sharded(MLP, mesh_dm))
    assert (tmp_path / "afile").read_text() == "not a directory"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda p, m: ts.save(None, m), r"path=None must be a directory path"),
        (lambda p, m: ts.save(3, m, step=-1), r"(?s)\(2 problems\).*path=3 must be a directory path.*step=-1"),
        (lambda p, m: ts.save_safetensors("", m), r"path='' must be a directory path"),
        (lambda p, m: ts.save_safetensors(p, {"w": m}), r"target must be a Trainer or a sharded module, got dict"),
        (lambda p, m: ts.save_safetensors(p, m, max_shard_bytes=True), r"max_shard_bytes=True must be an int ≥ 1"),
        (lambda p, m: ts.to_torch_state_dict({"w": m}), r"target must be a Trainer or a sharded module, got dict"),
        (lambda p, m: ts.from_torch_state_dict(m.state_dict(), {}, None), r"(?s)\(2 problems\).*model must be.*plan"),
        (
            lambda p, m: ts.from_torch_state_dict(m, m, None),
            r"state_dict must be a mapping name → tensor, e\.g\. torch\.load.*, got MLP",
        ),
        (
            lambda p, m: ts.from_torch_state_dict(MLP(), {"layers.0.weight": [1.0]}, ts.plan(MLP(), m.mesh)),
            r"state_dict\['layers\.0\.weight'\] is a list; values must be torch tensors or numpy arrays",
        ),
    ],
    ids=[
        "save_none",
        "save_int_and_step",
        "export_empty",
        "export_dict",
        "export_bool",
        "to_dict",
        "from_two",
        "from_module",
        "from_list",
    ],
)
def test_bad_arguments_of_save_and_export_are_argument_errors(tmp_path, mesh_dm, call, match):
    model = sharded(MLP, mesh_dm)
    model.mesh = mesh_dm  # for the calls that plan
    with pytest.raises(ts.ArgumentError, match=match):
        call(tmp_path, model)


# --- atomic safetensors exports ------------------------------------------------------------------


def export_state(directory: pathlib.Path) -> dict[str, np.ndarray] | None:
    """The tensors of a complete export in ``directory`` (None if there is none)."""
    if not (directory / "model.safetensors.index.json").exists():
        return None
    _, tensors = read_safetensors(directory)
    return {k: v.numpy() for k, v in tensors.items()}


def same(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray]) -> bool:
    return a is not None and a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in b)


def inject_export(monkeypatch, faults: Faults) -> None:
    inject(monkeypatch, faults)
    from torchshard import _safetensors

    counted = {name: faults.counting(name, getattr(os, name)) for name in ("mkdir", "makedirs", "link")}
    monkeypatch.setattr(_safetensors, "os", _Namespace(os, **counted))
    monkeypatch.setattr(safetensors.torch, "save_file", faults.counting("save_file", safetensors.torch.save_file))
    monkeypatch.setattr(pathlib.Path, "write_text", faults.counting("write_text", pathlib.Path.write_text))


def test_a_kill_at_any_step_of_an_export_keeps_a_complete_export(tmp_path, mesh_dm, monkeypatch):
    out, template = tmp_path / "export", tmp_path / "template"
    old_model, new_model = sharded(TiedLM, mesh_dm, TP_LM), sharded(TiedLM, mesh_dm, TP_LM, seed=1)
    ts.save_safetensors(template, new_model, max_shard_bytes=9000)
    new = export_state(template)
    ts.save_safetensors(template, old_model, max_shard_bytes=9000)
    (template / "config.json").write_text("{}")
    old = export_state(template)
    for at in range(1, 100):
        shutil.copytree(template, out)
        faults = Faults(at)
        with monkeypatch.context() as m:
            inject_export(m, faults)
            with contextlib.suppress(Killed):
                ts.save_safetensors(out, new_model, max_shard_bytes=9000)
        where = faults.steps[-1] if len(faults.steps) >= at else "nowhere"
        # a complete old or new export; killed between the two renames, the old one waits hidden beside it
        found = export_state(out if out.exists() else tmp_path / (OLD + "export"))
        assert same(found, old) or same(found, new), where
        ts.save_safetensors(out, old_model, max_shard_bytes=9000)  # recovers what the kill left, and works
        assert same(export_state(out), old) and (out / "config.json").read_text() == "{}", where
        assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "template"], where
        shutil.rmtree(out)
        if len(faults.steps) < at:
            break
    assert at > 8, faults.steps


def test_a_full_disk_during_an_export_keeps_the_previous_export(tmp_path, mesh_dm, monkeypatch):
    model = sharded(TiedLM, mesh_dm, TP_LM)
    ts.save_safetensors(tmp_path / "export", model, max_shard_bytes=9000)
    before = export_state(tmp_path / "export")
    fail = safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(fail))
    with pytest.raises(ts.CheckpointError, match=r"export: the disk is full .*; the previous export is intact\. Free"):
        ts.save_safetensors(tmp_path / "export", sharded(TiedLM, mesh_dm, TP_LM, seed=1))
    assert same(export_state(tmp_path / "export"), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_export_onto_a_file_is_a_checkpoint_error(tmp_path, mesh_dm):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ts.CheckpointError, match=r"afile: a file is in the way .*pass a directory path"):
        ts.save_safetensors(tmp_path / "afile", sharded(MLP, mesh_dm))


def test_an_export_into_the_working_directory_keeps_it_usable(tmp_path, mesh_dm, monkeypatch):
    (tmp_path / "export").mkdir()
    monkeypatch.chdir(tmp_path / "export")
    ts.save_safetensors(".", sharded(MLP, mesh_dm))
    ts.save_safetensors(".", sharded(MLP, mesh_dm, seed=1))  # replaces the directory the process is in
    assert pathlib.Path.cwd() == tmp_path / "export"
    assert pathlib.Path("model.safetensors.index.json").exists()
