"""Checkpoints: exact resume across meshes and plans, strict loads, damaged files, retention, bad calls."""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest
import torch
from torch import nn

import torchshard as ts
from testsupport.checkpoint_runs import (
    RUNS,
    TP_DROPOUT,
    TP_LM,
    Run,
    Saved,
    data_files,
    host_tree,
    make_trainer,
    mlp_batches,
    mse,
    sharded,
    values,
)
from testsupport.helpers import assert_close, torch_losses
from testsupport.models import MLP, Rotary, TiedLM
from torchshard import presets
from torchshard._bridge.tensors import wrap
from torchshard._ckpt.shards import unwritable


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


def test_a_module_saves_and_loads_onto_its_current_shardings(tmp_path, mesh_dm, mesh_fsdp):
    source = sharded(TiedLM, mesh_dm, TP_LM)
    target = sharded(TiedLM, mesh_fsdp, presets.fsdp(min_size=64), seed=1)
    shardings = {n: t.jax().sharding for n, t in target.state_dict(keep_vars=True).items()}
    assert ts.save(tmp_path, source) == tmp_path / "step_00000000"
    ts.load(tmp_path, target)
    jax.tree.map(np.testing.assert_array_equal, values(target), values(source))
    assert {n: t.jax().sharding for n, t in target.state_dict(keep_vars=True).items()} == shardings
    assert target.head.weight is target.embed.weight


def test_loaded_arrays_are_the_processs_own_memory_not_the_files(tmp_path, mesh_fsdp):
    """An array over the mapped file (what jax makes of an aligned read-only view) would fault when the file is
    truncated and would keep a deleted step's disk space; a load copies into memory of its own."""
    source = sharded(TiedLM, mesh_fsdp, presets.fsdp(min_size=64))
    target = sharded(TiedLM, mesh_fsdp, presets.fsdp(min_size=64), seed=1)
    ts.load(ts.save(tmp_path, source), target)
    for data in (tmp_path / "step_00000000" / "state").glob("*.bin"):
        data.write_bytes(b"")  # truncated in place: pages of a mapping over it would be gone (SIGBUS)
    jax.tree.map(np.testing.assert_array_equal, values(target), values(source))


def test_a_relative_path_saves_and_loads(tmp_path, mesh_fsdp, monkeypatch):
    """The README saves to "ckpt/": save and load resolve it against the cwd of the call."""
    monkeypatch.chdir(tmp_path)
    source = sharded(TiedLM, mesh_fsdp, presets.fsdp(min_size=64))
    target = sharded(TiedLM, mesh_fsdp, presets.fsdp(min_size=64), seed=1)
    assert ts.save("ckpt/", source) == tmp_path / "ckpt" / "step_00000000"
    ts.load("ckpt/", target)
    jax.tree.map(np.testing.assert_array_equal, values(target), values(source))


def test_a_trainer_checkpoint_loads_into_a_meta_module_with_a_plan(saved_run, mesh_fsdp):
    saved = saved_run("tiedlm_adamw")
    with torch.device("meta"):
        model = TiedLM()
    p = ts.plan(model, mesh_fsdp, presets.fsdp(min_size=64))
    ts.load(saved.path, model, plan=p)
    assert model.embed.weight.jax().sharding == p["embed.weight"]
    assert model.head.weight is model.embed.weight
    assert_close(model.block.up.weight, saved.state.params["block.up.weight"], tol=0)


def test_a_trainer_with_a_complex_rope_buffer_saves_loads_and_resumes_like_torch(tmp_path, mesh_fsdp):
    """torchtitan keeps RoPE's freqs_cis as a complex64 buffer: the checksum used to fail on it (bitcast)."""
    torch.manual_seed(0)
    reference = Rotary()
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 8, 16, generator=g) for _ in range(4)]
    first = ts.Trainer(copy.deepcopy(reference), loss, optax.sgd(0.1), ts.plan(reference, mesh_fsdp))
    got = [float(first.step(b)["loss"]) for b in batches[:2]]
    ts.save(tmp_path, first)
    second = ts.Trainer(Rotary(), loss, optax.sgd(0.1), ts.plan(reference, mesh_fsdp))
    ts.load(tmp_path, second)
    assert second.model.freqs_cis.dtype == torch.complex64
    np.testing.assert_array_equal(np.asarray(second.model.freqs_cis.jax()), reference.freqs_cis.numpy())
    got += [float(second.step(b)["loss"]) for b in batches[2:]]
    expected = torch_losses(reference, loss, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_a_sub_byte_buffer_round_trips(tmp_path, mesh_fsdp):
    """uint4 (which orbax's tensorstore could not hold) is stored as numpy holds it, one byte per value."""
    model, values_ = nn.Linear(4, 4), np.arange(16).reshape(8, 2) % 16
    ts.shard(model, ts.plan(model, mesh_fsdp))
    model.register_buffer("packed", wrap(jax.numpy.asarray(values_, jax.numpy.uint4)))
    ts.save(tmp_path, model)
    target = nn.Linear(4, 4)
    ts.shard(target, ts.plan(target, mesh_fsdp))
    target.register_buffer("packed", wrap(jax.numpy.zeros((8, 2), jax.numpy.uint4)))
    ts.load(tmp_path, target)
    np.testing.assert_array_equal(np.asarray(target.packed.jax()).astype(np.int32), values_)


def test_an_array_the_checkpoint_format_cannot_hold_is_named_with_the_fix():
    tree = {"model": {"w": jax.numpy.ones(2)}, "trainer": {"key": jax.random.key(0)}}
    (problem,) = unwritable(tree)
    assert re.fullmatch(
        r"\['trainer'\]\['key'\] \(\) key<fry>: .* cannot hold key<fry>; store jax.random.key_data.*", problem
    )


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
        r"(?s)is incomplete or truncated; load an earlier step \(1 problem\).*process_0+\.bin: 100 bytes, saved \d+",
    ),
    "deleted_data": (
        lambda d: data_files(d)[0].unlink(),
        r"(?s)incomplete or truncated.*state/process_0+\.bin: missing",
    ),
    "garbled_shard_index": (
        lambda d: (d / "state" / "process_00000.json").write_bytes(
            b"x" * (d / "state" / "process_00000.json").stat().st_size
        ),
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
