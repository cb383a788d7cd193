"""Context parallelism: the sequence split over a mesh axis, SDPA run as ring / all-gather attention, vs eager torch.

The attention kernel alone (against torch's dense SDPA, values and gradients) is tested in test_kernels.py.
"""

from __future__ import annotations

import copy
import functools
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch import nn

import torchshard as ts
from testsupport.helpers import run_benchmark, torch_losses
from testsupport.models import tiny_llama
from torchshard import ArgumentError, ContextParallel, ShardingError

SEQ, BATCH, VOCAB = 256, 2, 64
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.99), 1e-8, 0.01
VARIANTS = {
    "all_gather": ContextParallel(attention="all_gather", load_balance=False),
    "all_gather-balanced": ContextParallel(attention="all_gather"),
    "ring": ContextParallel(attention="ring", load_balance=False),
    "ring-balanced": ContextParallel(),
}
SLOW = pytest.mark.slow


class Attention(nn.Module):
    """Self-attention through ``F.scaled_dot_product_attention`` with grouped K/V heads."""

    def __init__(self, dim: int, heads: int, kv_heads: int, mask: str):
        super().__init__()
        self.heads, self.kv_heads, self.mask = heads, kv_heads, mask
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        mask = torch.ones(s, s, dtype=torch.bool).tril() if self.mask == "tril" else None
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.mask == "causal",
                                                       enable_gqa=True)  # fmt: skip
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class CausalLM(nn.Module):
    """A plain-torch pre-norm transformer LM: token + learned position embeddings, attention and MLP blocks."""

    def __init__(self, *, vocab=VOCAB, dim=32, heads=4, kv_heads=2, depth=2, seq=SEQ, mask="causal"):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.attn = nn.ModuleList(Attention(dim, heads, kv_heads, mask) for _ in range(depth))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                 for _ in range(depth))  # fmt: skip
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * depth + 1))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp, strict=True)):
            h = h + attn(self.norms[2 * i](h))
            h = h + mlp(self.norms[2 * i + 1](h))
        return self.head(self.norms[-1](h))


def one_layer_llama(**overrides):
    return tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, **overrides)


def lm_loss(model, batch):
    ids, labels = batch
    out = model(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batches(n, *, seq=SEQ, batch=BATCH, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (batch, seq + 1), generator=g) for _ in range(n)]
    return [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in ids]


def adamw():
    return optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)


def eager_losses(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return torch_losses(model, lm_loss, opt, data)


@pytest.fixture(scope="module")
def mesh():
    return ts.make_mesh({"data": 2, "context": 4})


def trainer_for(model, mesh, context, **kwargs):
    plan = ts.plan(model, mesh, kwargs.pop("rules", None))
    return ts.Trainer(model, lm_loss, kwargs.pop("optimizer", adamw()), plan, batch_spec=("data", "context"),
                      context=context, **kwargs)  # fmt: skip


def assert_trains_like_torch(model_fn, mesh, context, *, steps=3, batch=BATCH, **kwargs):
    torch.manual_seed(0)
    ref = model_fn()
    trainer = trainer_for(copy.deepcopy(ref), mesh, context, **kwargs)
    data = batches(steps, batch=batch)
    got = [float(trainer.step(b)["loss"]) for b in data]
    np.testing.assert_allclose(got, eager_losses(ref, data), rtol=1e-4)
    return trainer


# ---------------------------------------------------------------- training against eager torch


@pytest.mark.parametrize("variant", list(VARIANTS))
@SLOW
def test_causal_transformer_trains_like_torch(mesh, variant):
    assert_trains_like_torch(CausalLM, mesh, VARIANTS[variant])


@SLOW
@pytest.mark.parametrize("variant", ["all_gather", "ring", "ring-balanced"])
def test_llama_trains_like_torch(mesh, variant):
    assert_trains_like_torch(lambda: tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64), mesh,
                             VARIANTS[variant])  # fmt: skip


@SLOW
def test_a_four_layer_llama_trains_like_torch(mesh):
    """With 4 layers XLA moved the kernel's lax.axis_index out of the shard_map, which the partitioner refused."""
    model_fn = functools.partial(tiny_llama, layers=4, vocab_size=VOCAB, hidden_size=32, intermediate_size=64)
    assert_trains_like_torch(model_fn, mesh, ContextParallel(), steps=2)


@pytest.mark.parametrize("mask", ["tril", "none"])
@SLOW
def test_constant_masks_are_recognised(mesh, mask):
    """A constant causal mask the model builds runs as causal attention; no mask and not causal runs as full."""
    assert_trains_like_torch(functools.partial(CausalLM, mask=mask, depth=1), mesh, ContextParallel(), steps=2)


@pytest.mark.parametrize("variant", ["ring-balanced", "all_gather"])
@SLOW
def test_step_passes_blocks_round_the_context_axis(mesh, variant):
    trainer = trainer_for(CausalLM(depth=1), mesh, VARIANTS[variant])
    stats = ts.inspect.collectives(trainer, batches(1)[0])
    # K, V forward; K, V, dK, dV backward (and the zig-zag's reorderings): all collective-permutes over the axis
    assert stats.count("collective-permute", axes="context") >= 8, stats
    assert stats.count("collective-permute") == stats.count("collective-permute", axes="context"), stats
    # nothing is gathered: not the sequence over "context", nor (inside the shard_map) the batch over "data"
    assert stats.count("all-gather") == 0, stats


def hf_loss(model, batch):
    return model(batch[0], labels=batch[1]).loss


@SLOW
@pytest.mark.parametrize(("model_fn", "loss_fn"), [(CausalLM, lm_loss), (one_layer_llama, hf_loss)],
                         ids=["torch", "hf"])  # fmt: skip
def test_rows_per_shard_keep_the_sequence_split(mesh, model_fn, loss_fn):
    """4 rows per data shard: linear layers and the flattened loss keep each device's tokens, nothing is gathered.

    Flattening [rows, seq] tokens kept the split only with one row per device; GSPMD gathered whole
    sequences (f32[4,256,32] activations, s32[4,256] labels) over the context axis before.
    """
    torch.manual_seed(0)
    model = model_fn()
    trainer = ts.Trainer(model, loss_fn, adamw(), ts.plan(model, mesh), batch_spec=("data", "context"),
                         context=ContextParallel())  # fmt: skip
    stats = ts.inspect.collectives(trainer, batches(1, batch=8)[0])
    assert stats.count("all-gather") == 0, stats
    assert stats.count("all-to-all") == stats.count("all-to-all", axes="context") <= 3, stats  # the loss's tokens


@SLOW
def test_an_fsdp_sharded_head_gathers_no_logits(mesh):
    """The LM head's weight sharded over ``data`` (FSDP), transformers' loss flattening the logits rows-major.

    The logits' gradient then reached the linear's chunk-major backward in an order GSPMD could only
    fix by gathering all of it on every device: the whole [8, 256, 64] f32 logits here, and 774 GiB a
    device for Llama-3-8B at ``data=16, context=4``. Both sides of the reorder are pinned now.
    """
    torch.manual_seed(0)
    model = one_layer_llama()
    trainer = ts.Trainer(model, hf_loss, adamw(), ts.plan(model, mesh, ts.presets.fsdp(min_size=1)),
                         batch_spec=("data", "context"), context=ContextParallel())  # fmt: skip
    stats = ts.inspect.collectives(trainer, batches(1, batch=8)[0])
    logits = 8 * SEQ * VOCAB * 4
    assert max(op.bytes for op in stats.ops) <= logits // 8, stats  # a device's share, moved once


@SLOW
def test_rows_per_shard_train_like_torch(mesh):
    assert_trains_like_torch(functools.partial(CausalLM, depth=1), mesh, ContextParallel(), batch=8, steps=2)


def test_flattened_tokens_round_trip_in_sequence_chunk_major_order():
    from torchshard._bridge.ops import tokens

    x = jnp.arange(2 * 8 * 3 * 5).reshape(2, 8, 3, 5)
    with tokens.laid_out(tokens.TokenLayout(4)):
        flat = tokens.flatten(x)
        back = tokens.unflatten(flat, x.shape)
    assert flat.shape == (48, 5) and (back == x).all()
    # the first 2 × 2 × 3 flat tokens are sequence chunk 0 (positions 0, 1) of both rows
    np.testing.assert_array_equal(flat[:12], x[:, :2].reshape(12, 5))


# composition with remat, scan, MixedPrecision, grad accumulation, checkpoints and pipelines: test_matrix.py


# ---------------------------------------------------------------- what it cannot take


def test_sequence_the_axis_cannot_split(mesh):
    trainer = trainer_for(CausalLM(depth=1), mesh, ContextParallel())
    match = (
        r"batch leaf #0 \(2, 252\): the sequence \(length 252\) does not split into 8 equal chunks \(context size 4 "
        r"× 2 \(load_balance=True\)\); use a length that is a multiple of 8, e.g. 248 or 256"
    )
    with pytest.raises(ShardingError, match=match):
        trainer.step(batches(1, seq=252)[0])
    unbalanced = trainer_for(CausalLM(depth=1), mesh, ContextParallel(load_balance=False))
    with pytest.raises(ShardingError, match=r"length 250\) does not split into 4 equal chunks.*e.g. 248 or 252"):
        unbalanced.step(batches(1, seq=250)[0])


class Prefix(nn.Module):
    """Prepends 4 learned positions inside the model: the attention's sequence is not the batch's."""

    def __init__(self):
        super().__init__()
        self.lm = CausalLM(depth=1, seq=SEQ + 4)
        self.prefix = nn.Parameter(torch.zeros(1, 4, 32))

    def forward(self, ids):
        h = torch.cat([self.prefix.expand(ids.shape[0], -1, -1), self.lm.embed(ids)], dim=1)
        return self.lm.head(self.lm.attn[0](h))[:, 4:]


def padded_loss(model, batch):
    return model(batch[0], labels=batch[0], attention_mask=(batch[1] > 0).int()).loss


INNER_LENGTH = r"the attention's: the sequence \(length 260\) does not split into 8 equal chunks.*e.g. 256 or 264"
PADDING = (
    r"(?s)called by model.layers.0.self_attn under .* attn_mask bool\[2, 1, 256, 256\] is traced: transformers built "
    r"it from a 2-D attention_mask \w+\[2, 256\] \(padding.*context-parallel attention supports no mask, "
    r"is_causal=True, a constant causal mask.*or packed documents \(ts.document_mask\(position_ids\).*train without "
    r"an attention_mask \(unpadded rows\)"
)
DROPOUT = r"dropout_p=0.1 is not supported; set the model's attention dropout to 0"


@pytest.mark.parametrize(
    ("model_fn", "loss_fn", "match"),
    [
        (Prefix, lm_loss, INNER_LENGTH),
        (one_layer_llama, padded_loss, PADDING),
        (functools.partial(one_layer_llama, attention_dropout=0.1), lm_loss, DROPOUT),
    ],
    ids=["inner-length", "padding-mask", "dropout"],
)
def test_attention_calls_it_cannot_take(mesh, model_fn, loss_fn, match):
    model = model_fn()
    trainer = ts.Trainer(model, loss_fn, adamw(), ts.plan(model, mesh), batch_spec=("data", "context"),
                         context=ContextParallel())  # fmt: skip
    with pytest.raises(ShardingError, match=match):
        trainer.step(batches(1)[0])


class Masked(CausalLM):
    """One attention layer over a constant bool mask of its own: a causal band of ``window`` keys, or anti-causal."""

    def __init__(self, window: int | None):
        super().__init__(depth=1)
        self.window = window

    def forward(self, ids):
        s, ones = ids.shape[1], torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool)
        mask = ones.tril() & ones.triu(1 - self.window) if self.window else ones.triu()
        h = self.embed(ids) + self.pos(torch.arange(s))
        q = h.view(*h.shape[:2], 4, 8).transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return self.head(y.transpose(1, 2).reshape(h.shape))


def test_masks_it_cannot_honour(mesh):
    trainer = trainer_for(Masked(None), mesh, ContextParallel())
    match = r"attn_mask bool\[256, 256\] is a constant mask but neither all-visible, causal nor a causal sliding window"
    with pytest.raises(ShardingError, match=match):
        trainer.step(batches(1)[0])


@SLOW
@pytest.mark.parametrize("variant", ["ring-balanced", "all_gather"])
def test_a_constant_sliding_window_mask_runs_as_a_windowed_ring_and_trains_like_torch(mesh, variant):
    """A window of 40 keys: a device's 32-row runs (balanced) see two runs back at most; the rest is skipped."""
    trainer = assert_trains_like_torch(functools.partial(Masked, 40), mesh, VARIANTS[variant], steps=2)
    assert ts.inspect.collectives(trainer, batches(1)[0]).count("all-gather") == 0


def _family(model_type: str, **extra):
    from tools.families import DENSE, Family, build

    base = next(f for f in DENSE if f.model_type == model_type)
    return build(Family(model_type, extra=(*base.extra, *extra.items())))


def _family_trains_like_torch(mesh, model_type: str, **extra) -> ts.Trainer:
    from tools.families import lm_loss

    ref = _family(model_type, **extra)
    trainer = ts.Trainer(copy.deepcopy(ref), lambda m, b: lm_loss(m, b[0]), adamw(), ts.plan(ref, mesh),
                         batch_spec=("data", "context"), context=ContextParallel())  # fmt: skip
    data = [(ids % 125 + 3, None) for ids, _ in batches(3, seq=64)]
    got = [float(trainer.step(b)["loss"]) for b in data]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    np.testing.assert_allclose(got, torch_losses(ref, lambda m, b: lm_loss(m, b[0]), opt, data), rtol=1e-4)
    return trainer


@SLOW
def test_a_mistral_with_a_sliding_window_trains_like_torch_in_the_ring(mesh):
    """transformers builds the window as a constant banded mask: the ring reads its size and skips tiles outside."""
    trainer = _family_trains_like_torch(mesh, "mistral", sliding_window=12)
    assert trainer.model.config.sliding_window == 12
    stats = ts.inspect.collectives(trainer, (batches(1, seq=64)[0][0] % 125 + 3, None))
    assert stats.count("all-gather") == 0, stats


@SLOW
def test_gemma2_eager_attention_warns_once_that_the_sequence_is_gathered_and_trains_like_torch(mesh):
    with pytest.warns(ts.ContextParallelWarning) as caught:
        _family_trains_like_torch(mesh, "gemma2")
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert re.match(r"Gemma2ForCausalLM \(model_type 'gemma2', transformers' attn_implementation='eager', "
                    r"attn_logit_softcapping=50.0, which SDPA cannot apply\) calls no scaled_dot_product_attention"
                    r"[\s\S]*GSPMD all-gathers the sequence for its own attention in every layer",
                    str(caught[0].message))  # fmt: skip


@pytest.mark.parametrize(
    ("mesh_axes", "context", "batch_spec", "match"),
    [
        ({"data": 8}, ContextParallel(), ("data",), r"axis 'context' is not an axis of Mesh\(data=8\); add it"),
        (
            {"data": 2, "context": 4},
            ContextParallel(),
            ("data",),
            r"batch_spec P\('data',\) does not split the sequence \(dim 1\) over 'context'; "
            r"write batch_spec=\('data', 'context'\)",
        ),
        (
            {"data": 2, "seq": 4},
            ContextParallel(axis="seq"),
            ("seq", None),
            r"does not split the sequence \(dim 1\) over 'seq'",
        ),
    ],
)
def test_trainer_arguments_it_cannot_take(mesh_axes, context, batch_spec, match):
    mesh = ts.make_mesh(mesh_axes)
    model = CausalLM(depth=1)
    with pytest.raises(ShardingError, match=match):
        ts.Trainer(model, lm_loss, adamw(), ts.plan(model, mesh), batch_spec=batch_spec, context=context)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attention": "flash"}, r"attention='flash' must be one of \['ring', 'all_gather'\]"),
        ({"load_balance": 1}, r"load_balance=1 must be True or False"),
        ({"axis": 3}, r"axis=3 must be a mesh axis name"),
    ],
)
def test_context_parallel_arguments(kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        ContextParallel(**kwargs)


def test_trainer_refuses_a_context_that_is_not_a_context_parallel(mesh):
    model = CausalLM(depth=1)
    with pytest.raises(ArgumentError, match=r"context must be a ContextParallel\(...\) or None, got str"):
        ts.Trainer(model, lm_loss, adamw(), ts.plan(model, mesh), batch_spec=("data", "context"), context="ring")


@SLOW
def test_benchmark_memory_table():
    """benchmarks/context.py: at seq 512, context=4 needs at most 0.4× the temp memory of the whole sequence."""
    args = ["--seqs", "128,512", "--contexts", "1,4", "--steps", "1", "--time-up-to", "128"]
    stdout = run_benchmark("context.py", *args)
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.splitlines() if line.startswith("| ")]
    memory, times = rows[:3], rows[3:]
    assert memory[0] == times[0] == ["seq", "context=1", "context=1 + ContextParallel", "context=4"]
    ratio = float(memory[2][3].split("(")[1].rstrip("×)"))
    assert memory[2][0] == "512" and ratio <= 0.4, memory
    assert all(t.endswith(" ms") for t in times[1][1:]) and times[2][1:] == ["—"] * 3, times
