"""load_dcp / save_dcp against real torch.distributed.checkpoint: FSDP2 saves and loads on gloo CPU ranks (torchrun).

The torch side is ``fsdp2_dcp_script.py``: the MLP of ``mp_torchrun_script.py`` under ``fully_shard`` with torch
AdamW. Values are compared exactly (fp32, nothing computed on the way); training after a load is compared with
FSDP2's own continuation (AdamW loss trajectory, rtol 1e-4).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchshard as ts
from testsupport.full_disk import full_tmpfs, listing
from testsupport.helpers import assert_close
from torchshard import ArgumentError, CheckpointError

TESTS = Path(__file__).parent


def _script(name: str):
    """The script ``tests/NAME.py`` as a module, for its helpers (its main starts torch.distributed: not run)."""
    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fsdp2 = _script("fsdp2_dcp_script")

TORCHRUN = Path(sys.executable).with_name("torchrun")


def _torchrun(nproc: int, mode: str, folder: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), str(TESTS / "fsdp2_dcp_script.py"),
               mode, str(folder)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _loss(m, b):
    return torch.nn.functional.mse_loss(m(b[0]), b[1])


def _trainer(optimizer=None, mesh_axes=None, *, torch_optimizer=None) -> ts.Trainer:
    """A Trainer of the MLP on ``optimizer`` (optax), or on ``torch_optimizer(model.parameters())``."""
    model = _mlp()
    plan = ts.plan(model, ts.make_mesh(mesh_axes or {"data": 4, "model": 2}), ts.presets.fsdp(min_size=0))
    if torch_optimizer is not None:
        optimizer = torch_optimizer(model.parameters())
    return ts.Trainer(model, _loss, optimizer or optax.adamw(1e-2), plan)


def _values(state) -> dict:
    return {k: np.asarray(v, dtype=np.float32).tolist() for k, v in state.items()}


@pytest.fixture(scope="module")
def fsdp2_save(tmp_path_factory) -> tuple[Path, dict]:
    """FSDP2 on 2 gloo ranks: AdamW steps 0-3, ``dcp.save({"model", "optimizer"})``, steps 4-7."""
    folder = tmp_path_factory.mktemp("fsdp2")
    _torchrun(2, "save", folder)
    return folder, json.loads((folder / "fsdp2.json").read_text())


# --- FSDP2 → torchshard --------------------------------------------------------------------------


@pytest.mark.slow
def test_an_fsdp2_checkpoint_resumes_in_a_trainer_with_its_adamw_state(fsdp2_save, caplog):
    folder, torch_run = fsdp2_save
    trainer = _trainer()
    with caplog.at_level(logging.INFO, logger="torchshard"):
        ts.load_dcp(folder, trainer)
    assert _values(ts.to_torch_state_dict(trainer)) == torch_run["saved"]["model"]
    mu = trainer.state.opt_state[0].mu  # optax.adamw: chain(scale_by_adam, ...)
    saved = torch_run["saved"]["optimizer"]["state"]
    assert {k: np.asarray(v).tolist() for k, v in mu.items()} == {k: s["exp_avg"] for k, s in saved.items()}
    assert trainer.step_count == fsdp2.SAVED_AT == int(trainer.state.opt_state[0].count)
    losses = [float(trainer.step(fsdp2.batch(s))["loss"]) for s in range(fsdp2.SAVED_AT, fsdp2.STEPS)]
    assert_close(losses, torch_run["losses"][fsdp2.SAVED_AT :], tol=1e-4, what="losses after the load")
    assert "param_groups" in caplog.text  # the non-tensor entries are reported as not read


@pytest.mark.slow
def test_an_fsdp2_checkpoint_resumes_in_a_trainer_on_the_same_torch_optimizer(fsdp2_save):
    folder, torch_run = fsdp2_save
    trainer = ts.load_dcp(folder, _trainer(torch_optimizer=fsdp2.adamw))
    saved, exported = torch_run["saved"]["optimizer"], ts.optimizer_state_dict(trainer)
    names = saved["param_groups"][0]["params"]  # get_state_dict's names, in torch's order
    assert {names[i]: _values(s) for i, s in exported["state"].items()} == saved["state"]
    assert trainer.step_count == fsdp2.SAVED_AT
    losses = [float(trainer.step(fsdp2.batch(s))["loss"]) for s in range(fsdp2.SAVED_AT, fsdp2.STEPS)]
    assert_close(losses, torch_run["losses"][fsdp2.SAVED_AT :], tol=1e-4, what="losses after the load")


@pytest.mark.slow
def test_fsdp2_on_three_ranks_resumes_a_trainer_on_torch_adamw(tmp_path):
    trainer = _trainer(torch_optimizer=fsdp2.adamw)
    for s in range(fsdp2.SAVED_AT):
        trainer.step(fsdp2.batch(s))
    ts.save_dcp(tmp_path, trainer)
    _torchrun(3, "resume", tmp_path)
    theirs = json.loads((tmp_path / "resumed.json").read_text())["losses"]
    ours = [float(trainer.step(fsdp2.batch(s))["loss"]) for s in range(fsdp2.SAVED_AT, fsdp2.STEPS)]
    assert_close(theirs, ours, tol=1e-4, what="FSDP2's losses after reading save_dcp's torch AdamW state")


@pytest.mark.slow
def test_a_module_loads_the_model_part_and_reports_the_optimizer_state(fsdp2_save, caplog):
    folder, torch_run = fsdp2_save
    with torch.device("meta"):
        model = _mlp()
    plan = ts.plan(model, ts.make_mesh({"data": 8}), [(r".*weight", (None, "data"))])
    with caplog.at_level(logging.INFO, logger="torchshard"):
        ts.load_dcp(folder, model, plan)
    assert _values(ts.to_torch_state_dict(model)) == torch_run["saved"]["model"]
    assert "12 optimizer-state tensors" in caplog.text and "read boxes of" in caplog.text


# --- torchshard → plain dcp.load, FSDP2 on another number of ranks -------------------------------


@pytest.fixture(scope="module")
def trained() -> ts.Trainer:
    trainer = _trainer()
    for s in range(3):
        trainer.step(fsdp2.batch(s))
    return trainer


@pytest.mark.slow
def test_fsdp2_on_three_ranks_reads_what_save_dcp_wrote(trained, tmp_path):
    ts.save_dcp(tmp_path, trained)
    _torchrun(3, "load", tmp_path)
    assert json.loads((tmp_path / "loaded.json").read_text()) == _values(ts.to_torch_state_dict(trained))


@pytest.mark.slow
def test_two_torchrun_processes_read_their_slices_and_write_their_shards(fsdp2_save, tmp_path):
    """2 JAX processes × 2 CPU devices under torchrun: load_dcp of the FSDP2 save, train on, save_dcp; FSDP2 on 3
    ranks reads that back."""
    folder, torch_run = fsdp2_save
    shutil.copytree(folder, tmp_path / "fsdp2")
    env = {**os.environ, "TORCHSHARD_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(TESTS.parent)}  # fmt: skip
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(TESTS / "mp_torchrun_script.py"),
               str(tmp_path), "dcp"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"dcp.rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["started"] == fsdp2.SAVED_AT
        losses = [rank["losses"][str(s)] for s in range(fsdp2.SAVED_AT, fsdp2.STEPS)]
        assert_close(losses, torch_run["losses"][fsdp2.SAVED_AT :], tol=1e-4, what="2-process losses after load")
        read, total = (int(w) for w in rank["read"][0].split() if w.isdigit())
        assert read < total  # each process read its boxes only (model and AdamW state: half of each)
    _torchrun(3, "load", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "loaded.json").read_text()) == ranks[0]["state"]


def test_a_trainer_round_trip_resumes_exactly(trained, tmp_path):
    ts.save_dcp(tmp_path / "ckpt", trained)
    plain = {"model": _mlp().state_dict()}  # a plain torch model reads it too
    dcp.load(plain, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert _values(plain["model"]) == _values(ts.to_torch_state_dict(trained))
    resumed = ts.load_dcp(tmp_path / "ckpt", _trainer(mesh_axes={"data": 8}))  # another plan
    assert resumed.step_count == trained.step_count
    batch = fsdp2.batch(trained.step_count)
    assert_close(resumed.step(batch)["loss"], trained.step(batch)["loss"], tol=1e-6, what="the step after")
    assert_close(ts.to_torch_state_dict(resumed)["0.weight"], ts.to_torch_state_dict(trained)["0.weight"], tol=1e-6)


@pytest.mark.slow
def test_scanned_layers_round_trip_with_their_adamw_state(tmp_path):
    """A Llama Trainer saves; a scan_layers Trainer (stacked params and AdamW state) resumes it, saves, and an
    unscanned one resumes that: the same losses as the first Trainer going on."""
    from testsupport.models import tiny_llama

    def trainer(**options):
        model = tiny_llama(layers=2)
        plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.hf_rules(model))
        return ts.Trainer(model, lambda m, ids: m(input_ids=ids, labels=ids).loss, optax.adamw(1e-2), plan, **options)

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (8, 12), generator=g) for _ in range(4)]
    source = trainer()
    source.step(data[0])
    ts.save_dcp(tmp_path / "a", source)
    scanned = ts.load_dcp(tmp_path / "a", trainer(scan_layers=True))
    losses = [float(scanned.step(data[1])["loss"])]
    ts.save_dcp(tmp_path / "b", scanned)
    plain = ts.load_dcp(tmp_path / "b", trainer())
    losses += [float(plain.step(b)["loss"]) for b in data[2:]]
    assert_close(losses, [float(source.step(b)["loss"]) for b in data[1:]], tol=1e-5, what="resumed losses")


@pytest.mark.parametrize("layout", ["top", "nested"])
def test_plain_dcp_save_layouts_load_into_a_module(layout, tmp_path):
    source = _mlp()
    with torch.no_grad():
        source[0].weight.add_(1.0)
    state = source.state_dict() if layout == "top" else {"model": source.state_dict()}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    model = _mlp()
    ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8}), ts.presets.fsdp(min_size=0)))
    ts.load_dcp(tmp_path, model)
    assert _values(ts.to_torch_state_dict(model)) == _values(source.state_dict())


def test_rename_maps_other_names(tmp_path):
    source = _mlp()
    dcp.save({"model": {f"net.{k}": v for k, v in source.state_dict().items()}}, checkpoint_id=tmp_path, no_dist=True)
    model = _mlp()
    ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
    ts.load_dcp(tmp_path, model, rename=[(r"^net\.", "")])
    assert _values(ts.to_torch_state_dict(model)) == _values(source.state_dict())


# --- what cannot load ----------------------------------------------------------------------------


@pytest.fixture
def placed():
    model = _mlp()
    ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
    return model


def _save_changed(folder: Path, change) -> None:
    state = {k: v.clone() for k, v in _mlp().state_dict().items()}
    change(state)
    dcp.save({"model": state}, checkpoint_id=folder, no_dist=True)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s.pop("2.bias"), r"missing 2\.bias \(4,\): in the model, not in the checkpoint"),
        (lambda s: s.update({"2.bias": torch.zeros(5)}), r"mis-shaped 2\.bias \(stored as model\.2\.bias\): "
                                                         r"checkpoint \(5,\), model \(4,\)"),
        (lambda s: s.update({"3.weight": torch.zeros(2)}), r"unexpected 3\.weight .*\(2,\)"),
    ],
)  # fmt: skip
def test_missing_or_mis_shaped_tensors_change_nothing(change, match, placed, tmp_path):
    before = _values(ts.to_torch_state_dict(placed))
    _save_changed(tmp_path, lambda s: (s["0.weight"].add_(1), change(s)))
    with pytest.raises(CheckpointError, match=match):
        ts.load_dcp(tmp_path, placed)
    assert _values(ts.to_torch_state_dict(placed)) == before


def test_strict_false_keeps_what_is_missing(placed, tmp_path):
    before = ts.to_torch_state_dict(placed)
    _save_changed(tmp_path, lambda s: (s["0.weight"].add_(1), s.pop("2.bias")))
    ts.load_dcp(tmp_path, placed, strict=False)
    after = ts.to_torch_state_dict(placed)
    assert torch.equal(after["2.bias"], before["2.bias"]) and torch.equal(after["0.weight"], before["0.weight"] + 1)


def test_optimizer_state_that_does_not_map_is_named(trained, tmp_path):
    ts.save_dcp(tmp_path, trained)
    sgd = _trainer(optax.sgd(0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=r"optimizer state leaf .*trace.* has no torch AdamW counterpart"):
        ts.load_dcp(tmp_path, sgd)
    ts.load_dcp(tmp_path, sgd, strict=False)  # the weights and step count, with a fresh optimizer state
    assert sgd.step_count == trained.step_count and torch.equal(ts.to_torch_state_dict(sgd)["0.weight"],
                                               ts.to_torch_state_dict(trained)["0.weight"])  # fmt: skip


def test_torchtitans_layout_loads_and_its_training_loop_state_is_reported(tmp_path, caplog):
    """Model tensors at the top level, AdamW state flattened (flatten_optimizer_state_dict), loop state beside."""
    model = _mlp().state_dict()
    optimizer = {
        f"state.{n}.{field}": value
        for n, t in model.items()
        for field, value in (("exp_avg", t * 0.5), ("exp_avg_sq", t * t), ("step", torch.tensor(2.0)))
    }
    loop = {"train_state": {"step": torch.tensor(2)}, "lr_scheduler": {"last_epoch": 2}}  # fmt: skip
    dcp.save({**model, "optimizer": optimizer, **loop}, checkpoint_id=tmp_path, no_dist=True)
    trainer = _trainer()
    with caplog.at_level(logging.INFO, logger="torchshard"):
        ts.load_dcp(tmp_path, trainer)
    assert trainer.step_count == 2 and _values(ts.to_torch_state_dict(trainer)) == _values(model)
    assert torch.equal(torch.from_numpy(np.asarray(trainer.state.opt_state[0].mu["2.weight"])), model["2.weight"] * 0.5)
    assert "train_state.step" in caplog.text and "lr_scheduler.last_epoch" in caplog.text


@pytest.mark.parametrize(
    ("steps", "drop", "match"),
    [
        ([3, 3, 3, 2], None, r"AdamW steps differ between parameters \(\[2\.0, 3\.0\]\)"),
        ([3, 3, 3, 3], "2.bias", r"missing optimizer state 2\.bias\.exp_avg \(4,\)"),
    ],
)
def test_adamw_state_that_does_not_fit_optax(steps, drop, match, tmp_path):
    model = _mlp().state_dict()
    state = {n: {"exp_avg": torch.ones_like(t), "exp_avg_sq": torch.ones_like(t), "step": torch.tensor(float(s))}
             for (n, t), s in zip(model.items(), steps, strict=True) if n != drop}  # fmt: skip
    dcp.save({"model": model, "optimizer": {"state": state}}, checkpoint_id=tmp_path, no_dist=True)
    trainer = _trainer()
    with pytest.raises(CheckpointError, match=match):
        ts.load_dcp(tmp_path, trainer)
    assert trainer.step_count == 0
    ts.load_dcp(tmp_path, trainer, strict=False)  # what maps: the count at the largest step, missing state fresh
    assert trainer.step_count == 3 and float(trainer.state.opt_state[0].nu["0.weight"].sum()) == 32 * 16


def test_not_a_dcp_checkpoint(placed, tmp_path):
    with pytest.raises(CheckpointError, match=r"is not a torch.distributed.checkpoint folder: it has no \.metadata"):
        ts.load_dcp(tmp_path, placed)
    with pytest.raises(CheckpointError, match=r"no such directory"):
        ts.load_dcp(tmp_path / "missing", placed)
    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"cannot be read as DCP metadata"):
        ts.load_dcp(tmp_path, placed)


def test_bad_arguments(placed, tmp_path):
    with pytest.raises(
        ArgumentError,
        match=r"(?s)invalid load_dcp\(\) arguments.*target must be a Trainer .*strict must be True or False",
    ):
        ts.load_dcp(tmp_path, object(), strict=1)
    with pytest.raises(ArgumentError, match=r"target must be a Trainer or a sharded module"):
        ts.save_dcp(tmp_path, object())
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"is a file; save_dcp writes a folder"):
        ts.save_dcp(tmp_path / "file", placed)


def test_an_existing_checkpoint_is_replaced_whole(placed, tmp_path):
    ts.save_dcp(tmp_path / "c", _trainer())  # with optimizer state
    ts.save_dcp(tmp_path / "c", placed)  # without: nothing of the first is left
    names = dcp.FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata
    assert sorted(names) == sorted(f"model.{n}" for n in _mlp().state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_unplaced_module_cannot_be_saved(tmp_path):
    with pytest.raises(ts.ShardingError, match=r"save_dcp\(\): Sequential is not sharded"):
        ts.save_dcp(tmp_path / "out", _mlp())
    assert listing(tmp_path) == []  # no empty .torchshard-tmp-out/ left behind
    assert jax.process_count() == 1


# --- damaged files, full disks, the user's rename= raising: the bad-input table ------------------------------


DAMAGE = {
    "random_bytes": (lambda f: f.write_bytes(random.Random(0).randbytes(f.stat().st_size)), r"is corrupted \(\w+: "),
    "cut_in_half": (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]), r"is cut short \(\d+ bytes; "
                                                                                      r"the metadata places"),
    "deleted": (lambda f: f.unlink(), r"is missing"),
}  # fmt: skip


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_data_file_is_a_checkpoint_error_naming_it_and_nothing_changes(damage, placed, tmp_path):
    source = _mlp()
    ts.save_dcp(tmp_path / "c", ts.shard(source, ts.plan(source, ts.make_mesh({"data": 8}))))
    before = _values(ts.to_torch_state_dict(placed))
    change, match = DAMAGE[damage]
    change(tmp_path / "c" / "__0_0.distcp")
    file = str(tmp_path / "c" / "__0_0.distcp")
    fix = r"nothing was loaded\. Load another checkpoint, or copy this one again whole"
    with pytest.raises(CheckpointError, match=rf"DCP checkpoint .*/c is damaged: {file} {match}.*; {fix}"):
        ts.load_dcp(tmp_path / "c", placed)
    assert _values(ts.to_torch_state_dict(placed)) == before


def test_a_data_file_given_for_its_folder_names_the_folder(placed, tmp_path):
    ts.save_dcp(tmp_path / "c", placed)
    with pytest.raises(CheckpointError, match=rf"__0_0.distcp is a file of a DCP checkpoint; pass the folder "
                                              rf"dcp.save wrote \(checkpoint_id\): {tmp_path / 'c'}$"):  # fmt: skip
        ts.load_dcp(tmp_path / "c" / "__0_0.distcp", placed)


def test_adamw_state_into_a_trainer_on_sgd_is_refused_unless_not_strict(trained, tmp_path):
    ts.save_dcp(tmp_path, trained)
    sgd = _trainer(optax.sgd(0.1))
    with pytest.raises(CheckpointError, match=r"holds AdamW state \(exp_avg, exp_avg_sq, step\) that the Trainer's "
                                              r"optimizer keeps no state for: build the Trainer with the optimizer "
                                              r"that saved it"):  # fmt: skip
        ts.load_dcp(tmp_path, sgd)
    assert sgd.step_count == 0
    ts.load_dcp(tmp_path, sgd, strict=False)  # the weights and the step count, as documented
    assert sgd.step_count == trained.step_count
    assert _values(ts.to_torch_state_dict(sgd)) == _values(ts.to_torch_state_dict(trained))


def _boom(name):
    raise KeyError(f"no rule for {name}")


@pytest.mark.parametrize("target", ["module", "trainer"])
def test_a_rename_that_raises_is_an_argument_error_naming_the_call(target, trained, placed, tmp_path):
    ts.save_dcp(tmp_path, trained)
    calls = []  # the 4 model names are renamed first, then a Trainer's optimizer entries' parameter names

    def rename(name):
        calls.append(name)
        return _boom(name) if target == "module" or len(calls) > 4 else name

    loaded = placed if target == "module" else _trainer()
    with pytest.raises(ArgumentError, match=r"rename=.* raised KeyError: 'no rule for .*' for the checkpoint name "
                                            r"'.*'; nothing was loaded: fix it") as info:  # fmt: skip
        ts.load_dcp(tmp_path, loaded, rename=rename)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [((3,), {}, r"path=3 must be a directory path"),
     ((), {"rename": "model."}, r"rename is a str; rename must be a callable"),
     ((), {"plan": "fsdp"}, r"plan must be a ShardingPlan"),
     ((), {"strict": "yes"}, r"strict must be True or False")],
)  # fmt: skip
def test_load_dcp_argument_table(args, kwargs, match, placed, tmp_path):
    with pytest.raises(ArgumentError, match=match):
        ts.load_dcp(*(args or (tmp_path,)), placed, **kwargs)


@pytest.mark.parametrize("disk", ["full", "fills_mid_file"])
def test_save_dcp_on_a_full_disk_is_a_checkpoint_error_and_leaves_the_earlier_checkpoint_alone(disk, tmp_path):
    # full: an earlier checkpoint there, then not a byte free (an OSError); fills_mid_file: 64 KiB for 128 KiB
    # of weights (torch's zip writer reports the short write as a RuntimeError "enforce fail at inline_container")
    model = torch.nn.Linear(256, 128)
    ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
    earlier = (lambda root: ts.save_dcp(root / "c", _trainer())) if disk == "full" else None
    with full_tmpfs(tmp_path / "disk", size_kib=256 if earlier else 64, before=earlier, fill=disk == "full") as root:
        before = listing(root)
        full = r"the disk is full \(No space left on device.*\)"
        fix = r"the previous checkpoint is intact\. Free space or write elsewhere, then save again"
        with pytest.raises(CheckpointError, match=rf"{root / 'c'}: {full}; {fix}"):
            ts.save_dcp(root / "c", model)
        assert listing(root) == before  # no .torchshard-tmp-c/, no shard of it
        if disk == "full":  # the earlier checkpoint, whole
            ts.load_dcp(root / "c", _trainer())
