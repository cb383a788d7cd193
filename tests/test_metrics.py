"""Run metrics: the logged line and values against eager torch, FLOPs from the HLO, MFU, memory, no sync per step."""

from __future__ import annotations

import copy
import json
import logging
import re

import jax
import numpy as np
import optax
import pytest
import torch

import torchshard as ts
from testsupport.full_disk import full_tmpfs, listing
from testsupport.helpers import torch_losses
from testsupport.models import MLP, BlockStack, tiny_llama
from torchshard._base.errors import ArgumentError
from torchshard._hlo.hardware import PROFILES, for_device_kind
from torchshard._hlo.memory import CompiledMemory
from torchshard._trainer import observed
from torchshard._trainer.run_metrics import batch_counts, device_memory, host_rss, step_line

SIZES = (32, 64, 16)
ROWS = 64
RATES = {"step_time_s", "samples_per_s", "tflops_per_device", "recompute_ratio", "memory_peak_bytes", "host_rss_bytes"}


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def batches(n, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ROWS, SIZES[0], generator=g), torch.randn(ROWS, SIZES[-1], generator=g)) for _ in range(n)]


def mlp_trainer(mesh, **kwargs):
    torch.manual_seed(0)
    model = MLP(SIZES)
    eager = copy.deepcopy(model)
    return ts.Trainer(model, mse, optax.sgd(0.1), ts.plan(model, mesh), **kwargs), eager


@pytest.mark.slow
def test_every_nth_step_is_logged_with_the_losses_eager_torch_trains_with(mesh_fsdp, tmp_path, caplog):
    trainer, eager = mlp_trainer(mesh_fsdp, log_every=2, trackers=[ts.track.JSONL(tmp_path / "m.jsonl")])
    data = batches(6)
    with caplog.at_level(logging.INFO, logger="torchshard"):
        for batch in data:
            trainer.step(batch)
    trainer.close()
    expected = torch_losses(eager, mse, torch.optim.SGD(eager.parameters(), lr=0.1), data)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6]
    np.testing.assert_allclose([r["loss"] for r in rows], expected[1::2], rtol=1e-4)
    assert set(rows[0]) >= RATES and "mfu" not in rows[0]  # CPU: no published peak, so no MFU
    assert "tokens_per_s" not in rows[0]  # float features, no token ids: samples per second only
    for row in rows:
        assert row["samples_per_s"] == pytest.approx(ROWS / row["step_time_s"], rel=1e-6)
        assert row["tflops_per_device"] == pytest.approx(trainer.flops_per_step / row["step_time_s"] / 1e12)
    lines = [r.getMessage() for r in caplog.records if r.name == "torchshard"]
    assert len(lines) == 3
    assert re.fullmatch(r"step: 2  loss: \d\.\d{4}  grad_norm: \d\.\d{4}  memory: [\d.]+KiB  tflops: [\d.]+  "
                        r"step_time: [\d.]+s", lines[0]), lines[0]  # fmt: skip
    assert f"loss: {rows[1]['loss']:.4f}" in lines[1]


def test_device_values_are_read_only_every_log_every_steps(mesh_fsdp, monkeypatch):
    reads = []
    real = observed.Observer._values
    monkeypatch.setattr(observed.Observer, "_values", lambda self, m: reads.append(1) or real(self, m))
    trainer, _ = mlp_trainer(mesh_fsdp, log_every=5)
    for batch in batches(2) * 5:
        trainer.step(batch)
    assert len(reads) == 2  # steps 5 and 10; the other eight steps queue without waiting


def test_flops_per_step_is_every_matmul_of_forward_and_backward(mesh_fsdp):
    trainer, _ = mlp_trainer(mesh_fsdp)
    with pytest.raises(ArgumentError, match=r"run trainer.step\(batch\) first"):
        trainer.flops_per_step  # noqa: B018
    trainer.step(batches(1)[0])
    rows = ROWS // 8  # per device: the batch is split over data=8
    forward = 2 * rows * (SIZES[0] * SIZES[1] + SIZES[1] * SIZES[2])
    first_input_grad = 2 * rows * SIZES[0] * SIZES[1]  # the batch needs no gradient: XLA never computes it
    assert trainer.flops_per_step == 3 * forward - first_input_grad
    assert trainer.model_flops_per_step == trainer.flops_per_step  # nothing rematerialised


@pytest.mark.slow
def test_recompute_is_counted_once_for_mfu_and_reported_as_a_ratio(mesh_fsdp, tmp_path):
    ids = torch.randint(0, 64, (16, 8))
    loss = lambda m, ids: torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())  # noqa: E731

    def trainer(**kwargs):
        torch.manual_seed(0)
        model = BlockStack(depth=3)
        return ts.Trainer(model, loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp), scan_layers=True, **kwargs)

    plain, jsonl = trainer(), ts.track.JSONL(tmp_path / "m.jsonl")
    remat = trainer(remat=r"blocks\.\d+", log_every=1, trackers=[jsonl], peak_flops=1e12)
    plain.step(ids)
    remat.step(ids)
    assert remat.model_flops_per_step == plain.flops_per_step
    # each block's up projection runs again in the backward (its output feeds GELU's derivative)
    rows = 16 // 8
    assert remat.flops_per_step - plain.flops_per_step == 3 * 2 * rows * 8 * 32 * 64
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row["recompute_ratio"] == pytest.approx(remat.flops_per_step / plain.flops_per_step)
    assert row["mfu"] == pytest.approx(plain.flops_per_step / row["step_time_s"] / 1e12)  # peak_flops=1e12


@pytest.mark.slow
def test_tokens_are_counted_from_the_token_ids(mesh_fsdp, tmp_path):
    model = tiny_llama(layers=1)
    jsonl = ts.track.JSONL(tmp_path / "m.jsonl")
    loss = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    trainer = ts.Trainer(model, loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp), log_every=2, trackers=[jsonl])
    ids = torch.randint(0, 128, (8, 16))
    for _ in range(4):
        trainer.step(ids)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        assert row["tokens_per_s"] == pytest.approx(8 * 16 / row["step_time_s"], rel=1e-6)
        assert row["samples_per_s"] == pytest.approx(8 / row["step_time_s"], rel=1e-6)


@pytest.mark.slow
def test_a_llamas_model_flops_are_the_analytic_count_and_recomputed_scores_come_on_top(mesh_fsdp):
    model = tiny_llama(layers=1)  # width 64 (4 heads), MLP 128, vocab 128, untied head
    loss = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    trainer = ts.Trainer(model, loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp))
    trainer.step(torch.randint(0, 128, (8, 256)))  # one row of 256 tokens per device: 4 × 4 attention tiles
    embedding = model.get_input_embeddings().weight.numel()  # a lookup, not a matmul
    matmul_params = sum(p.numel() for p in model.parameters() if p.ndim == 2) - embedding
    tokens, width, seq = 256, 64, 256
    assert trainer.model_flops_per_step == tokens * (6 * matmul_params + 12 * width * seq)  # torchtitan's count
    # the tiled attention's backward computes the scores once more, as FlashAttention's does
    assert trainer.flops_per_step - trainer.model_flops_per_step == tokens * 2 * width * seq


@pytest.mark.slow
def test_module_calls_are_named_by_their_state_dict_prefix_in_the_hlo(mesh_fsdp):
    model = tiny_llama(layers=2)
    loss = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    trainer = ts.Trainer(model, loss, optax.sgd(0.1), ts.plan(model, mesh_fsdp))
    hlo = trainer.lower(torch.randint(0, 128, (8, 16))).compile().as_text()
    scopes = {part for name in re.findall(r'op_name="([^"]*)"', hlo) for part in name.split("/")}
    assert {"model.layers.0.self_attn", "model.layers.1.mlp", "model.layers.1.self_attn.q_proj"} <= scopes


def test_profile_traces_the_steps_with_their_layer_names(mesh_fsdp, tmp_path):
    trainer, _ = mlp_trainer(mesh_fsdp)
    batch = batches(1)[0]
    trainer.step(batch)
    with trainer.profile(tmp_path / "trace"):
        trainer.step(batch)
    [trace] = (tmp_path / "trace").glob("plugins/profile/*/*.xplane.pb")
    ran = {e.name for p in jax.profiler.ProfileData.from_file(str(trace)).planes for line in p.lines
           for e in line.events}  # fmt: skip
    # each XLA op the trace shows executing, named by the module scope its HLO metadata gives it
    hlo = trainer.lower(batch).compile().as_text()
    scope_of = dict(re.findall(r"%([\w.\-]+) = [^\n]*?op_name=\"[^\"]*?(layers\.\d)\b", hlo))
    assert {scope_of[op] for op in ran if op in scope_of} == {"layers.0", "layers.1"}
    assert b"layers.1" in trace.read_bytes()  # the HLO that xprof shows with the trace holds the names
    trainer.save_memory_profile(tmp_path / "memory" / "step.prof")
    assert (tmp_path / "memory" / "step.prof").read_bytes()[:2] == b"\x1f\x8b"  # gzipped pprof


def test_memory_falls_back_to_the_compiled_step_where_the_device_reports_none(mesh_fsdp, tmp_path):
    trainer, _ = mlp_trainer(mesh_fsdp, log_every=1, trackers=[ts.track.JSONL(tmp_path / "m.jsonl")])
    batch = batches(1)[0]
    trainer.step(batch)
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row["memory_peak_bytes"] == CompiledMemory.of(trainer.lower(batch).compile()).peak_bytes
    assert 0 < row["host_rss_bytes"] == pytest.approx(host_rss(), rel=0.5)


class FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_memory_is_the_largest_over_the_devices():
    devices = [FakeDevice({"bytes_in_use": 5, "peak_bytes_in_use": 9, "bytes_limit": 100}), FakeDevice(None),
               FakeDevice({"bytes_in_use": 7, "peak_bytes_in_use": 8, "bytes_limit": 100})]  # fmt: skip
    assert device_memory(devices) == {"memory_peak_bytes": 9, "memory_bytes": 7, "memory_limit_bytes": 100}
    assert device_memory([FakeDevice(None)]) == {}
    assert "memory: 9B(9.00%)" in step_line(3, {"memory_peak_bytes": 9, "memory_limit_bytes": 100})


@pytest.mark.parametrize(
    ("kind", "profile"),
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"), ("NVIDIA H200", "h200"),
     ("NVIDIA A100-SXM4-80GB", "a100"), ("TPU v5p", "tpu-v5p"), ("TPU v5 lite", "tpu-v5e"), ("TPU v5e", "tpu-v5e"),
     ("cpu", None), ("NVIDIA GeForce RTX 4090", None)],
)  # fmt: skip
def test_device_kinds_find_their_hardware_profile(kind, profile):
    assert for_device_kind(kind) == (PROFILES[profile] if profile else None)


@pytest.mark.parametrize(
    ("leaves", "counts"),
    [([np.zeros((4, 16), np.int32)], (64, 4)), ([np.zeros((4, 3), np.float32)], (0, 4)),
     ([np.zeros((4, 16, 2), np.int64), np.zeros((4,), np.int64)], (64, 4)), ([np.zeros((), np.float32)], (0, 0))],
)  # fmt: skip
def test_batch_counts(leaves, counts):
    assert batch_counts(leaves) == counts


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"log_every": 0}, r"log_every=0 must be an int ≥ 1 or None"),
     ({"log_every": -3}, r"log_every=-3 must be an int"),
     ({"log_every": 2.5}, r"log_every=2.5 must be an int"),
     ({"log_every": True}, r"log_every=True must be an int"),
     ({"peak_flops": -1.0}, r"peak_flops=-1.0 must be a positive number"),
     ({"log_every": 0, "trackers": [object()]}, r"log_every=0.*\n.*trackers\[0\] is <object")],
)  # fmt: skip
def test_bad_logging_arguments_are_refused_before_anything_moves(mesh_fsdp, kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        mlp_trainer(mesh_fsdp, **kwargs)


def test_an_unwritable_profile_logdir_is_refused_before_tracing(mesh_fsdp, tmp_path):
    trainer, _ = mlp_trainer(mesh_fsdp)
    (tmp_path / "file").write_text("")
    refused = pytest.raises(ArgumentError, match=r"profile logdir .*file/trace' cannot be created: .*file' is a file")
    with refused, trainer.profile(tmp_path / "file" / "trace"):
        pass
    with pytest.raises(ArgumentError, match=r"memory profile path .* exists and is a directory"):
        trainer.save_memory_profile(tmp_path)


def test_profiles_do_not_nest_and_the_refused_one_writes_nothing(mesh_fsdp, tmp_path):
    trainer, _ = mlp_trainer(mesh_fsdp)
    batch = batches(1)[0]
    refused = pytest.raises(ArgumentError, match=r"trainer.profile\('.*inner'\): a jax.profiler trace is already "
                                                 r"running in this process .*; profiles do not nest")  # fmt: skip
    with trainer.profile(tmp_path / "outer"):
        with refused, trainer.profile(tmp_path / "inner"):
            pass
        trainer.step(batch)  # the outer trace goes on
    assert not (tmp_path / "inner").exists() and list((tmp_path / "outer").glob("plugins/profile/*/*.xplane.pb"))
    with trainer.profile(tmp_path / "again"):  # and a later one starts: the refused one stopped nothing
        trainer.step(batch)


@pytest.mark.parametrize("where", ["mem.prof", "new/folders/mem.prof"])
def test_a_memory_profile_on_a_full_disk_is_a_checkpoint_error_that_leaves_nothing(mesh_fsdp, tmp_path, where):
    trainer, _ = mlp_trainer(mesh_fsdp)
    with full_tmpfs(tmp_path / "disk") as disk:
        full = r"could not be written \(No space left on device\); nothing was left behind: free space"
        with pytest.raises(ts.CheckpointError, match=rf"memory profile '.*mem.prof' {full}"):
            trainer.save_memory_profile(disk / where)
        assert listing(disk) == []


@pytest.mark.parametrize(
    ("path", "message"),
    [(3, r"memory profile path must be a path \(str or pathlib.Path\), got int"),
     ("", r"memory profile path '\.' exists and is a directory"),
     ("/proc/version/mem.prof", r"cannot be created: '/proc/version' is a file")],
)  # fmt: skip
def test_bad_memory_profile_paths_are_argument_errors(mesh_fsdp, path, message):
    trainer, _ = mlp_trainer(mesh_fsdp)
    with pytest.raises(ArgumentError, match=message):
        trainer.save_memory_profile(path)
