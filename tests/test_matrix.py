"""Every parallel strategy × every training feature, against eager torch: one table, so a missing pair shows.

Rows are the strategies (the two pipeline schedules, ring and all-gather context parallelism, all-to-all
expert dispatch), columns what a Trainer adds to any of them (remat, scan_layers, MixedPrecision, gradient
accumulation, a checkpoint round-trip). Each supported pair trains a tiny model 3 AdamW steps and matches
eager, unsharded torch: fp32 losses rtol 1e-4; MixedPrecision losses match an eager torch twin of the bf16
policy within testsupport.precision.RTOL (the spread measured there), or, for the MoE, the strategy-free Trainer
under the same policy (see `Family.twin`). A checkpoint saved after 2 steps is loaded into a strategy-free
Trainer on another mesh, whose third step must be eager torch's. Each unsupported pair asserts its
ShardingError. COMBOS keeps runs of several features, and of two strategies, at once, some on transformers
families. bf16 MixedPrecision × all-to-all on data × expert × model (a Mixtral) runs in a child process in
test_expert_dispatch.py: the program XLA once aborted on took the process with it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P
from torch import nn

import torchshard as ts
from testsupport.helpers import torch_losses
from testsupport.models import BlockStack, Experts, MoEStack, TinyTransformer, tiny_llama
from testsupport.precision import LR as MIXED_LR
from testsupport.precision import RTOL as MIXED_RTOL
from testsupport.precision import WD as MIXED_WD
from testsupport.precision import torch_mixed_precision
from torchshard import ContextParallel, ExpertDispatch, Pipeline, ShardingError, presets

LR, WD, RTOL, STEPS = 1e-2, 0.01, 1e-4, 3
VOCAB, SEQ = 64, 16


# ---------------------------------------------------------------- tiny models, their losses and batches


def token_loss(model, batch):
    ids, labels = batch
    out = model(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def moe_loss(model, batch):
    x, y = batch
    return (model(x.to(model.embed.weight.dtype)).float() - y.float()).square().mean()


def token_batches(rows: int) -> list[Any]:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g) for _ in range(STEPS)]
    return [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in ids]


def float_batches(rows: int) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    shape = (rows, 4, Experts.dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(STEPS)]


def _fsdp_tp(colwise: list[str], rowwise: list[str]) -> Callable[[dict[str, int]], ts.Rules | None]:
    """FSDP over "data" and tensor parallelism over "model", each where the mesh has the axis."""

    def rules(axes: dict[str, int]) -> ts.Rules | None:
        out = presets.fsdp("data", min_size=256) if "data" in axes else None
        if "model" in axes:
            tp = presets.tensor_parallel(colwise=colwise, rowwise=rowwise)
            out = tp + out if out is not None else tp
        return out

    return rules


def _llama() -> nn.Module:
    return tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64)


LLAMA_LAYER = r"model\.layers\.\d+"


def _hf(model_type: str) -> Callable[[], nn.Module]:
    from tools.families import MOE, build

    return lambda: build(next(f for f in MOE if f.model_type == model_type))


def _hf_llama() -> nn.Module:
    import transformers

    # grouped KV heads (4 over 2), head_dim = hidden / heads, an untied head, as Llama-3-8B
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def _hf_mistral() -> nn.Module:
    import transformers

    # a sliding window of 8 over 16-token rows: transformers builds it as a constant [B, 1, S, S] band mask
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=64, sliding_window=8)  # fmt: skip
    return transformers.MistralForCausalLM(config)


def hf_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def hf_batches(rows: int) -> list[Any]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (rows, SEQ), generator=g) for _ in range(STEPS)]


def _hf_experts(model_type: str) -> Callable[[dict[str, int]], ts.Rules]:
    """Experts split by expert over "expert" (transformers' ep_plan), the rest replicated."""
    return lambda axes: presets.hf_rules(_hf(model_type)(), axis=None, expert_axis="expert", fsdp_axis=None)


@dataclasses.dataclass(frozen=True)
class Family:
    """A tiny model (built under seed 0), its loss, its batches and the names remat and the plan use."""

    build: Callable[[], nn.Module]
    loss: Callable[..., torch.Tensor]
    batches: Callable[[], list[Any]]  # rows enough for every strategy's data axes × 2 accumulation steps
    remat: str
    rules: Callable[[dict[str, int]], ts.Rules | None]
    # whether the eager bf16 twin is the MixedPrecision truth. The MoE's is not: torch on CPU adds its 8
    # experts' bf16 outputs in bf16 and XLA in fp32, so the twin and the strategy-free Trainer differ by
    # 1.1e-3 (the all-to-all run and the strategy-free one by 4e-5); the strategy-free Trainer is its truth
    twin: bool = True


FAMILIES = {
    "blocks": Family(lambda: BlockStack(depth=4), token_loss, lambda: token_batches(16), r"blocks\.\d+",
                     _fsdp_tp([r"blocks\.\d+\.up"], [r"blocks\.\d+\.down"])),
    "attention": Family(TinyTransformer, token_loss, lambda: token_batches(4), r"blocks\.\d+",
                        _fsdp_tp([r"blocks\.\d+\.(q|kv|up)"], [r"blocks\.\d+\.(out|down)"])),
    "llama": Family(_llama, token_loss, lambda: token_batches(4), LLAMA_LAYER,
                    _fsdp_tp([rf"{LLAMA_LAYER}\.self_attn\.[qkv]_proj", rf"{LLAMA_LAYER}\.mlp\.(gate|up)_proj"],
                             [rf"{LLAMA_LAYER}\.self_attn\.o_proj", rf"{LLAMA_LAYER}\.mlp\.down_proj"])),
    "moe": Family(MoEStack, moe_loss, lambda: float_batches(16), r"layers\.\d+",
                  lambda axes: presets.expert_parallel([r".*experts\.(up|down)"], "expert"), twin=False),
    # transformers' own Llama: its loss flattens the logits rows-major, as users' HF models do (see COMBOS)
    "hf_llama": Family(_hf_llama, hf_loss, lambda: hf_batches(8), LLAMA_LAYER,
                       lambda axes: presets.fsdp("data", min_size=256) if "data" in axes else None),
    "hf_mistral": Family(_hf_mistral, hf_loss, lambda: hf_batches(8), LLAMA_LAYER,
                         lambda axes: presets.fsdp("data", min_size=256) if "data" in axes else None),
    # transformers MoE families: their experts build index tensors inside the dispatch (see COMBOS)
    **{t: Family(_hf(t), hf_loss, lambda: hf_batches(8), LLAMA_LAYER, _hf_experts(t))
       for t in ("mixtral", "qwen2_moe")},
}  # fmt: skip


def model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family].build()


@functools.cache
def truth(family: str, mixed: bool) -> tuple[float, ...]:
    """The truth: eager unsharded torch, AdamW, fp32 (or the eager twin of the bf16 policy; see `Family.twin`)."""
    f = FAMILIES[family]
    if mixed and not f.twin:
        built = model(family)
        plan = ts.plan(built, ts.make_mesh({"data": 4, "model": 2}))
        free = ts.Trainer(built, f.loss, optax.adamw(MIXED_LR, weight_decay=MIXED_WD), plan,
                          precision=ts.MixedPrecision())  # fmt: skip
        return tuple(float(free.step(b)["loss"]) for b in f.batches())
    if mixed:
        return tuple(torch_mixed_precision(model(family), f.loss, f.batches()))
    ref = model(family)
    return tuple(torch_losses(ref, f.loss, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD), f.batches()))


# ---------------------------------------------------------------- the strategies and the features


@dataclasses.dataclass(frozen=True)
class Strategy:
    family: str
    axes: dict[str, int]
    kwargs: dict[str, Any]


STRATEGIES = {
    "gpipe": Strategy("blocks", {"stage": 4, "data": 2}, {"pipeline": Pipeline(microbatches=4)}),
    "circular": Strategy("blocks", {"stage": 2, "data": 2, "model": 2},
                         {"pipeline": Pipeline(microbatches=2, schedule="circular", repeats=2)}),
    "context ring": Strategy("attention", {"data": 2, "context": 4},  # the all-gather run shards by TP too
                             {"context": ContextParallel(), "batch_spec": ("data", "context")}),
    "context all_gather": Strategy("attention", {"data": 2, "context": 2, "model": 2},
                                   {"context": ContextParallel(attention="all_gather"),
                                    "batch_spec": ("data", "context")}),
    "expert all_to_all": Strategy("moe", {"data": 2, "expert": 4},
                                  {"expert_dispatch": ExpertDispatch(), "batch_spec": P(("data", "expert"))}),
}  # fmt: skip
FEATURES = ("remat", "scan", "MixedPrecision", "grad_accum", "checkpoint")
# each registered parallel strategy's rows above; the keywords that are no parallel strategy are tested elsewhere
ROWS = {"pipeline": ("gpipe", "circular"), "context": ("context ring", "context all_gather"),
        "expert_dispatch": ("expert all_to_all",)}  # fmt: skip
NOT_PARALLEL = {
    "fused_loss": "tests/test_linear_cross_entropy.py",
    "attention_kernel": "tests/test_attention_kernels.py",
}


def rowless_strategies() -> list[str]:
    """The registered strategies (torchshard._strategies.STRATEGIES) this matrix has no row for."""
    from torchshard._strategies import STRATEGIES as REGISTERED

    return sorted(set(REGISTERED) - set(ROWS) - set(NOT_PARALLEL))


def feature_kwargs(feature: str, family: Family) -> dict[str, Any]:
    return {
        "remat": {"remat": family.remat},
        "scan": {"scan_layers": True},
        "MixedPrecision": {"precision": ts.MixedPrecision()},
        "grad_accum": {"grad_accum_steps": 2},
        "checkpoint": {},  # trained alone; the round-trip is the test
    }[feature]


OK = "supported"
# strategy → one entry per FEATURES column: OK, or "raises: <regex of its ShardingError>"
MATRIX: dict[str, tuple[str, ...]] = {
    #                      remat scan  MixedPrecision grad_accum checkpoint
    "gpipe":              (OK,   OK,   OK,            OK,        OK),
    "circular":           (OK,   OK,   OK,            OK,        OK),
    "context ring":       (OK,   OK,   OK,            OK,        OK),
    "context all_gather": (OK,   OK,   OK,            OK,        OK),
    "expert all_to_all":  (OK,   OK,   OK,            OK,        OK),
}  # fmt: skip
# the quick suite's share of the matrix (the cheapest cells, a few seconds in all); the rest are marked slow
QUICK = {("circular", "scan"), ("expert all_to_all", "grad_accum")}


def trainer(strategy: str, features: tuple[str, ...], *, family: str | None = None, axes: dict[str, int] | None = None,
            **extra: Any) -> ts.Trainer:  # fmt: skip
    """A Trainer of the strategy's family model on its mesh, with the features' arguments and ``extra`` on top."""
    s = STRATEGIES[strategy]
    f = FAMILIES[family or s.family]
    kwargs = dict(s.kwargs)
    for feature in features:
        kwargs |= feature_kwargs(feature, f)
    kwargs |= extra
    axes = axes or s.axes
    built = model(family or s.family)
    mixed = "precision" in kwargs
    optimizer = optax.adamw(MIXED_LR if mixed else LR, weight_decay=MIXED_WD if mixed else WD)
    return ts.Trainer(built, f.loss, optimizer, ts.plan(built, ts.make_mesh(axes), f.rules(axes)), **kwargs)


def assert_matches_truth(run: ts.Trainer, family: str, *, mixed: bool, losses: list[float] | None = None) -> None:
    losses = losses or [float(run.step(b)["loss"]) for b in FAMILIES[family].batches()]
    np.testing.assert_allclose(losses, truth(family, mixed), rtol=MIXED_RTOL if mixed else RTOL)
    assert list(ts.to_torch_state_dict(run.model)) == list(model(family).state_dict())


@pytest.fixture(scope="module")
def plain():
    """family → a strategy-free Trainer on data=4 × model=2, replicated: where checkpoints are loaded."""
    runs: dict[str, ts.Trainer] = {}

    def get(family: str) -> ts.Trainer:
        if family not in runs:
            built = model(family)
            plan = ts.plan(built, ts.make_mesh({"data": 4, "model": 2}))
            runs[family] = ts.Trainer(built, FAMILIES[family].loss, optax.adamw(LR, weight_decay=WD), plan)
        return runs[family]

    return get


def _cells() -> list[Any]:
    return [
        pytest.param(strategy, feature, marks=() if (strategy, feature) in QUICK else pytest.mark.slow,
                     id=f"{strategy}-{feature}".replace(" ", "_"))
        for strategy in STRATEGIES for feature in FEATURES
    ]  # fmt: skip


def test_every_registered_strategy_has_rows():
    assert rowless_strategies() == [], "add a Strategy row (and its MATRIX line) for each, and name it in ROWS"
    assert {row for rows in ROWS.values() for row in rows} == set(STRATEGIES)


def test_the_matrix_has_every_pair():
    assert set(MATRIX) == set(STRATEGIES)
    assert all(len(row) == len(FEATURES) for row in MATRIX.values())
    assert all(cell == OK or cell.startswith("raises: ") for row in MATRIX.values() for cell in row)


@pytest.mark.parametrize(("strategy", "feature"), _cells())
def test_pair(strategy, feature, plain, tmp_path):
    expected = MATRIX[strategy][FEATURES.index(feature)]
    family = STRATEGIES[strategy].family
    data = FAMILIES[family].batches()
    if expected != OK:
        with pytest.raises(ShardingError, match=expected.removeprefix("raises: ")):
            trainer(strategy, (feature,)).step(data[0])
        return
    run = trainer(strategy, (feature,))
    if feature != "checkpoint":
        assert_matches_truth(run, family, mixed=feature == "MixedPrecision")
        return
    losses = [float(run.step(b)["loss"]) for b in data[:2]]
    ts.save(tmp_path, run)
    resumed = plain(family)
    ts.load(tmp_path, resumed)
    assert resumed.step_count == 2
    assert_matches_truth(resumed, family, mixed=False, losses=[*losses, float(resumed.step(data[2])["loss"])])


# ---------------------------------------------------------------- several at once (moved from the strategies' files)

COMBOS = {
    "gpipe + MixedPrecision + remat + grad_accum": dict(
        strategy="gpipe", features=("MixedPrecision", "grad_accum"), remat=r"blocks\.\d+\.up"),
    "expert all_to_all + scan + remat + grad_accum": dict(
        strategy="expert all_to_all", features=("scan", "remat", "grad_accum")),
    "context ring + FSDP×TP + remat + scan + grad_accum (Llama)": dict(
        strategy="context ring", features=("remat", "scan", "grad_accum"), family="llama"),
    # inside a pipeline's stages (a vmap over the stage axis) the ring's shard_map takes that axis as manual too
    "context ring + gpipe (Llama)": dict(
        strategy="context ring", features=(), family="llama", axes={"stage": 2, "data": 2, "context": 2},
        pipeline=Pipeline(microbatches=2)),
    # transformers' loss flattens the logits under the context layout inside stages that also split rows over
    # "data": its sharding constraints may not name the vmapped data axis (issue 55's regression)
    "context ring + gpipe (HF Llama)": dict(
        strategy="context ring", features=(), family="hf_llama", axes={"stage": 2, "data": 2, "context": 2},
        pipeline=Pipeline(microbatches=2)),
    "context all_gather + 1f1b (HF Llama)": dict(
        strategy="context all_gather", features=(), family="hf_llama", axes={"stage": 2, "data": 2, "context": 2},
        pipeline=Pipeline(microbatches=2, schedule="1f1b")),
    # the window mask is a constant built outside the stack: split into micro-batches it would be traced, and the
    # ring could not read it as a window; one row of it goes to every micro-batch instead
    "context ring + gpipe (HF Mistral, sliding window)": dict(
        strategy="context ring", features=(), family="hf_mistral", axes={"stage": 2, "data": 2, "context": 2},
        pipeline=Pipeline(microbatches=2)),
    # 1F1B runs the model's code before the stack under autodiff: the mask must come out of it a constant too
    "context ring + 1f1b (HF Mistral, sliding window)": dict(
        strategy="context ring", features=(), family="hf_mistral", axes={"stage": 2, "data": 2, "context": 2},
        pipeline=Pipeline(microbatches=2, schedule="1f1b")),
    "expert all_to_all + gpipe": dict(
        strategy="expert all_to_all", features=(), axes={"stage": 2, "expert": 4}, batch_spec=P("expert"),
        pipeline=Pipeline(microbatches=2)),
    # transformers' experts call torch.arange inside the dispatch's shard_map, where "context" stays automatic
    **{f"context ring + expert all_to_all ({t})": dict(
        strategy="expert all_to_all", features=(), family=t, axes={"context": 2, "expert": 4},
        batch_spec=P("expert", "context"), context=ContextParallel()) for t in ("mixtral", "qwen2_moe")},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMBOS))
def test_combination(name):
    spec = dict(COMBOS[name])
    strategy, features = spec.pop("strategy"), spec.pop("features")
    run = trainer(strategy, features, **spec)
    family = spec.get("family") or STRATEGIES[strategy].family
    assert_matches_truth(run, family, mixed="MixedPrecision" in features)
