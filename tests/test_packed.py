"""Packed documents (position ids restarting per document) under every strategy, against eager torch."""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import torchshard as ts
from testsupport.helpers import assert_attention_matches, run_benchmark
from testsupport.models import tiny_llama
from testsupport.packed import (
    SEQ,
    VOCAB,
    adamw,
    eager_losses,
    packed_batches,
    packed_loss,
    packed_positions,
)
from torchshard import ArgumentError, ContextParallel, ShardingError
from torchshard._strategies.context.documents import segment_ids
from torchshard._strategies.context.ring_attention import context_attention

SLOW = pytest.mark.slow
VARIANTS = {
    "all_gather": ContextParallel(attention="all_gather", load_balance=False),
    "all_gather-balanced": ContextParallel(attention="all_gather"),
    "ring": ContextParallel(attention="ring", load_balance=False),
    "ring-balanced": ContextParallel(),
}


# device chunks of 512 tokens over context=4: 128 natural, 64 balanced. Rows: documents crossing
# chunk boundaries, one document filling the row, a padded tail (its own document), many short ones
KERNEL_ROWS = [[100, 200, 50, 162], [512], [300, 150, 62], [40] * 12 + [32]]


# ---------------------------------------------------------------- helpers


def test_segment_ids_start_where_positions_do_not_continue():
    pos = torch.tensor([[5, 6, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]])
    assert segment_ids(pos).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0] * 7]


def test_document_mask_is_causal_within_each_document():
    mask = ts.document_mask(packed_positions([[3, 2], [5]]))
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    one = torch.ones(5, 5, dtype=torch.bool).tril()
    two = one.clone()
    two[3:, :3] = False
    assert torch.equal(mask[0, 0], two) and torch.equal(mask[1, 0], one)


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        (torch.tensor([[0, 1, 2, 5, 6]]), r"row 0, token 3: position 5 after 2 neither continues its document"),
        (torch.tensor([[0, 1, -1, 0]]), r"row 0 has negative positions"),
        (torch.tensor([[0.0, 1.0]]), r"position_ids \(1, 2\) torch.float32: needs integer positions"),
        (torch.zeros(1, 1, 4, dtype=torch.long), r"needs integer positions of shape \[batch, seq\] or \[seq\]"),
        ([[0, 1, 0]], r"must be an integer torch.Tensor .* got list \[\[0, 1, 0\]\]; pass torch.as_tensor"),
        (np.array([[0, 1, 0]]), r"must be an integer torch.Tensor .* got ndarray array\(\[\[0, 1, 0\]\]\); pass"),
        (torch.zeros(1, 0, dtype=torch.long), r"position_ids \(1, 0\) torch.int64: a row needs at least one token"),
    ],
    ids=["jump", "negative", "float", "rank-3", "list", "numpy", "no_tokens"],
)
def test_document_mask_refuses_positions_that_are_not_restarts(positions, match):
    with pytest.raises(ArgumentError, match=match):
        ts.document_mask(positions)


# ---------------------------------------------------------------- the kernel against torch's SDPA


@pytest.fixture(scope="module")
def mesh():
    return ts.make_mesh({"data": 2, "context": 4})


KERNEL_CASES = [
    # (variant, heads, kv_heads, key_tile): small tiles fold a run in several tiles, some skipped
    ("ring-balanced", 4, 2, 512),
    ("ring", 4, 1, 32),
    ("all_gather", 4, 2, 64),
    ("all_gather-balanced", 2, 2, 32),
]


@pytest.mark.parametrize(("variant", "heads", "kv_heads", "key_tile"), KERNEL_CASES)
def test_document_attention_matches_torch_sdpa(mesh, variant, heads, kv_heads, key_tile):
    context = VARIANTS[variant]
    g = torch.Generator().manual_seed(2)
    shapes = [(4, heads, 512, 8), (4, kv_heads, 512, 8), (4, kv_heads, 512, 8), (4, heads, 512, 8)]
    q, k, v, w = (torch.randn(s, generator=g) for s in shapes)
    pos = packed_positions(KERNEL_ROWS)
    mask = ts.document_mask(pos)

    def torch_fn(q, k, v):
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        return (nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask) * w).sum()

    segments = jnp.asarray(segment_ids(pos).numpy())
    attend = functools.partial(context_attention, mesh=mesh, axis="context", causal=True, key_tile=key_tile,
                               gathered=context.attention == "all_gather", balanced=context.load_balance,
                               segments=segments, rows=("data",))  # fmt: skip
    assert_attention_matches(attend, torch_fn, mesh, q, k, v, w)


# ---------------------------------------------------------------- training against eager torch


class PackedAttention(nn.Module):
    """Plain-torch self-attention over packed rows: ``ts.document_mask`` confines it to each document."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q, self.kv, self.out = (
            nn.Linear(dim, dim),
            nn.Linear(dim, 2 * kv_heads * self.head_dim),
            nn.Linear(dim, dim),
        )

    def forward(self, x, mask):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class PackedLM(nn.Module):
    """A plain-torch causal LM whose position embeddings and attention follow the batch's position ids."""

    def __init__(self, dim: int = 32, depth: int = 2):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ, dim)
        self.layers = nn.ModuleList(PackedAttention(dim) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)

    def forward(self, input_ids, position_ids, use_cache=False):
        h, mask = self.embed(input_ids) + self.pos(position_ids), ts.document_mask(position_ids)
        for layer in self.layers:
            h = h + layer(h, mask)
        return self.head(self.norm(h))


def llama():
    return tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64)


def family(model_type: str, **kwargs):
    from tools.families import Family, build

    return functools.partial(build, Family(model_type, **kwargs))


MODELS = {
    "torch": PackedLM,
    "llama": llama,
    "qwen3": family("qwen3"),
    "qwen3_moe": family("qwen3_moe", moe=True),
    "hrm_text": family("hrm_text"),
}


def moe_rules(model):
    return ts.presets.hf_rules(model, axis=None, expert_axis="expert", fsdp_min_size=1024)


# (model, mesh, batch_spec, rows, Trainer keywords): every strategy on the same packed batch
DATA_CONTEXT = ({"data": 2, "context": 4}, ("data", "context"))
STRATEGIES = {
    **{f"context-{v}-torch": ("torch", *DATA_CONTEXT, 4, {"context": VARIANTS[v]}) for v in VARIANTS},
    "context-ring-balanced-llama": ("llama", *DATA_CONTEXT, 4, {"context": VARIANTS["ring-balanced"]}),
    "context-all_gather-llama": ("llama", *DATA_CONTEXT, 4, {"context": VARIANTS["all_gather"]}),
    "context-ring-qwen3": ("qwen3", *DATA_CONTEXT, 4, {"context": VARIANTS["ring"]}),
    "context-all_gather-balanced-qwen3": ("qwen3", *DATA_CONTEXT, 4, {"context": VARIANTS["all_gather-balanced"]}),
    # HRM runs its early recurrent cycles under torch.no_grad: no gradient may flow back through them
    "context-ring-hrm_text": ("hrm_text", *DATA_CONTEXT, 4, {"context": VARIANTS["ring"]}),
    "context-scan-remat-accumulation-llama": (
        "llama", *DATA_CONTEXT, 8,
        {"context": ContextParallel(), "scan_layers": True, "remat": ts.Remat(r"model\.layers\.\d+"),
         "grad_accum_steps": 2},
    ),
    "context-pipeline-llama": (
        "llama", {"stage": 2, "data": 2, "context": 2}, ("data", "context"), 4,
        {"context": ContextParallel(), "pipeline": ts.Pipeline(microbatches=2)},
    ),
    "context-pipeline-1f1b-llama": (
        "llama", {"stage": 2, "data": 2, "context": 2}, ("data", "context"), 4,
        {"context": ContextParallel(), "pipeline": ts.Pipeline(microbatches=2, schedule="1f1b")},
    ),
    # the ring attention's shard_maps in both halves of the cut backward
    "context-pipeline-zero_bubble-llama": (
        "llama", {"stage": 2, "data": 2, "context": 2}, ("data", "context"), 4,
        {"context": ContextParallel(), "pipeline": ts.Pipeline(microbatches=2, schedule="zero_bubble")},
    ),
    "data-torch": ("torch", {"data": 4}, ("data",), 4, {}),
    "data-llama": ("llama", {"data": 4}, ("data",), 4, {}),
    "accumulation-llama": ("llama", {"data": 2}, ("data",), 4, {"grad_accum_steps": 2}),
    "remat-torch": ("torch", {"data": 4}, ("data",), 4, {"remat": ts.Remat(r"layers\.\d+")}),
    "scan-llama": ("llama", {"data": 4}, ("data",), 4, {"scan_layers": True}),
    "pipeline-llama": ("llama", {"stage": 2, "data": 2}, ("data",), 4, {"pipeline": ts.Pipeline(microbatches=2)}),
    # the loss is the mean over micro-batches of the token means: here they count 506 and 507 tokens
    "pipeline-1f1b-llama": (
        "llama", {"stage": 2, "data": 2}, ("data",), 4, {"pipeline": ts.Pipeline(microbatches=2, schedule="1f1b")},
    ),
    "expert-dispatch-qwen3_moe": ("qwen3_moe", {"data": 2, "expert": 4}, (("data", "expert"),), 8, {}),
}  # fmt: skip


@SLOW
@pytest.mark.parametrize("case", list(STRATEGIES))
def test_packed_batch_trains_like_torch(case):
    name, axes, batch_spec, rows, kwargs = STRATEGIES[case]
    torch.manual_seed(0)
    ref = MODELS[name]()
    model = copy.deepcopy(ref)
    rules = moe_rules(model) if name == "qwen3_moe" else None
    mesh = ts.make_mesh(axes, devices=jax.devices()[: int(np.prod(list(axes.values())))])
    trainer = ts.Trainer(model, packed_loss, adamw(), ts.plan(model, mesh, rules), batch_spec=batch_spec, **kwargs)
    if name == "qwen3_moe":
        assert trainer.strategies["expert_dispatch"].option == ts.ExpertDispatch("all_to_all")
    data = packed_batches(2, rows)
    got = [float(trainer.step(b)["loss"]) for b in data]
    np.testing.assert_allclose(got, eager_losses(ref, data), rtol=1e-4)


def test_an_integer_mask_that_is_not_document_ids(mesh):
    class Odd(PackedLM):
        def forward(self, input_ids, position_ids, use_cache=False):
            h = self.embed(input_ids)
            q = h.view(*h.shape[:2], 4, 8).transpose(1, 2)
            ids = position_ids[:, None, :, None].int()  # [B, 1, S, 1]: not ts.document_mask's [B, 1, 1, S]
            y = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=ids)
            return self.head(y.transpose(1, 2).reshape(h.shape))

    model = Odd(depth=1)
    trainer = ts.Trainer(model, packed_loss, adamw(), ts.plan(model, mesh), batch_spec=("data", "context"),
                         context=ContextParallel())  # fmt: skip
    with pytest.raises(ShardingError, match=r"integer attn_mask int32\[4, 1, 256, 1\] is not ts.document_mask's"):
        trainer.step(packed_batches(1)[0])


@SLOW
def test_benchmark_reports_the_skipped_tiles():
    """benchmarks/context.py --documents: packed rows skip more ring tiles than causal rows alone."""
    skipped = []
    for documents in ("0", "64"):
        args = ["--seqs", "256", "--contexts", "4", "--batch", "4", "--documents", documents, "--steps", "0"]
        stdout = run_benchmark("context.py", *args)
        line = next(x for x in stdout.splitlines() if x.startswith("context=4: ring tiles skipped"))
        skipped.append(int(line.rsplit(" ", 1)[1].rstrip("%")))
    assert skipped == [44, 81], skipped


@pytest.mark.filterwarnings("ignore::torchshard.UnusedRuleWarning")
def test_a_model_with_a_sparse_attention_indexer_is_refused_up_front(mesh):
    """DeepSeek-V3.2's indexer reads the attention mask in the model's own code (it failed with an OverflowError
    inside the step on packed documents' integer mask)."""
    from tools.families import build, family

    model = build(family("deepseek_v32"))
    with pytest.raises(ShardingError, match=r"DeepseekV32ForCausalLM has sparse-attention indexers \(model.layers.0."
                       r"self_attn.indexer, 2 in all\) .* train it without context="):  # fmt: skip
        ts.Trainer(model, packed_loss, adamw(), ts.plan(model, mesh), batch_spec=("data", "context"),
                   context=ContextParallel())  # fmt: skip
