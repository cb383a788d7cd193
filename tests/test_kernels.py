"""The parallel kernels alone, without a Trainer: each against a plain dense reference, values and gradients.

* the pipeline loop (`pipeline.run`) against a sequential ``lax.scan`` over the same stacked layers;
* ring and all-gather attention (`context_attention`) against torch's dense SDPA;
* all-to-all expert dispatch (`all_to_all._moved`) against every token through its top-k experts, weighted.

Tolerance: fp32 values and gradients within 1e-5 relative to scale (`helpers.assert_close`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import torchshard as ts
from testsupport.helpers import assert_attention_matches, assert_close
from testsupport.models import Experts
from torchshard import ShardingError
from torchshard._bridge.env import env
from torchshard._strategies.context.ring_attention import context_attention
from torchshard._strategies.context.ring_layout import SequenceLayout
from torchshard._strategies.experts import all_to_all, experts
from torchshard._strategies.pipeline import loop as pipeline
from torchshard._strategies.pipeline.schedules import SCHEDULES
from torchshard._strategies.pipeline.stages import resolve


def _close_trees(got, want) -> None:
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        assert_close(a, b, what=jax.tree_util.keystr(path))


# ---------------------------------------------------------------- the pipeline loop against a sequential scan

LAYERS, ROWS, SEQ, DIM = 8, 8, 3, 16


def _layer(params, h, others, key):
    """One residual layer; ``gate`` [B, T, 1] is split with the rows, ``shift`` [D] reaches every micro-batch whole."""
    gate, shift = others
    return h + gate * jnp.tanh(h @ params["w"] + params["b"] + shift), key


def _pipeline_inputs():
    k = jax.random.split(jax.random.key(0), 5)
    params = {
        "w": jax.random.normal(k[0], (LAYERS, DIM, DIM)) * DIM**-0.5,
        "b": jax.random.normal(k[1], (LAYERS, DIM)) * 0.1,
    }
    h = jax.random.normal(k[2], (ROWS, SEQ, DIM))
    others = (jax.random.uniform(k[3], (ROWS, SEQ, 1)), jax.random.normal(k[4], (DIM,)))
    return params, h, others


def _readout(out):
    return (out * jnp.cos(out)).sum()  # a scalar whose gradient differs per element


@pytest.mark.parametrize(
    ("schedule", "repeats", "remat"),
    [("gpipe", 1, False), ("circular", 2, False), ("gpipe", 1, True)],
    ids=["gpipe", "circular", "gpipe-remat"],
)
def test_pipeline_loop_matches_a_sequential_scan(schedule, repeats, remat):
    mesh = ts.make_mesh({"stage": 4, "data": 2})
    remats = SCHEDULES[schedule].remats_each_layer  # circular recomputes each layer in the backward
    stages = resolve(ts.Pipeline(microbatches=4, schedule=schedule, repeats=repeats), mesh, prefix="layers",
                     layers=LAYERS, batch="data", remats_each_layer=remats)  # fmt: skip
    order = np.asarray(stages.order())
    policy = jax.checkpoint_policies.nothing_saveable if remat else None
    params, h, others = _pipeline_inputs()

    def piped(params, h, others):
        stored = {name: array[order] for name, array in params.items()}  # stage by stage, as a Trainer stores them
        return _readout(pipeline.run(stages, _layer, stored, h, others, jax.random.key(1), policy=policy)[0])

    def sequential(params, h, others):
        return _readout(jax.lax.scan(lambda h, p: (_layer(p, h, others, None)[0], None), h, params)[0])

    got = jax.jit(jax.value_and_grad(piped, argnums=(0, 1, 2)))(params, h, others)
    want = jax.jit(jax.value_and_grad(sequential, argnums=(0, 1, 2)))(params, h, others)
    assert_close(got[0], want[0], what="value")
    _close_trees(got[1], want[1])
    assert float(jnp.abs(want[1][2][0]).max()) > 0.1  # the gate's gradient reaches it through the micro-batches


def test_pipeline_loop_refuses_rows_the_microbatches_do_not_split():
    mesh = ts.make_mesh({"stage": 4, "data": 2})
    stages = resolve(ts.Pipeline(microbatches=4), mesh, prefix="layers", layers=LAYERS)
    params, h, others = _pipeline_inputs()
    with pytest.raises(ShardingError, match=r"layers: the hidden state \[6, 3, 16\] does not split into "
                       r"microbatches=4 along dim 0; .* multiple of 4, e.g. 8"):  # fmt: skip
        pipeline.run(stages, _layer, params, h[:6], others, jax.random.key(1), where="layers")


# ---------------------------------------------------------------- ring / all-gather attention against torch's SDPA

ATTENTION_CASES = [
    # (gathered, balanced, causal, heads, kv_heads, key_tile): small tiles fold the 128 (64 balanced) key runs
    (False, True, True, 4, 2, 512),
    (False, True, False, 4, 4, 512),
    (False, False, True, 4, 1, 64),
    (True, False, True, 4, 2, 512),
    (True, True, True, 2, 2, 32),
    (True, False, False, 4, 2, 64),
]
# (gathered, balanced, window, key_tile): causal sliding windows, shorter than a tile, a run, or spanning runs
WINDOW_CASES = [(False, True, 100, 32), (False, False, 7, 64), (True, True, 200, 512), (False, True, 1, 512)]


@pytest.mark.parametrize(("gathered", "balanced", "causal", "heads", "kv_heads", "key_tile"), ATTENTION_CASES)
def test_attention_matches_torch_sdpa(gathered, balanced, causal, heads, kv_heads, key_tile):
    mesh = ts.make_mesh({"data": 2, "context": 4})
    g = torch.Generator().manual_seed(1)
    shapes = [(4, heads, 512, 8), (4, kv_heads, 512, 8), (4, kv_heads, 512, 8), (4, heads, 512, 8)]
    q, k, v, w = (torch.randn(s, generator=g) for s in shapes)

    def torch_fn(q, k, v):
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return (out * w).sum()

    attend = functools.partial(context_attention, mesh=mesh, axis="context", causal=causal, key_tile=key_tile,
                               gathered=gathered, balanced=balanced)  # fmt: skip
    assert_attention_matches(attend, torch_fn, mesh, q, k, v, w)


@pytest.mark.parametrize(("gathered", "balanced", "key_tile"), [(False, True, 64), (True, False, 512)])
def test_attention_with_a_value_head_dim_other_than_the_querys_matches_torch_sdpa(gathered, balanced, key_tile):
    # multi-head latent attention (DeepSeek-V3: queries and keys 192 wide, values 128), here 12 against 8
    mesh = ts.make_mesh({"data": 2, "context": 4})
    g = torch.Generator().manual_seed(4)
    shapes = [(4, 4, 512, 12), (4, 2, 512, 12), (4, 2, 512, 8), (4, 4, 512, 8)]
    q, k, v, w = (torch.randn(s, generator=g) for s in shapes)

    def torch_fn(q, k, v):
        return (nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * w).sum()

    attend = functools.partial(context_attention, mesh=mesh, axis="context", causal=True, key_tile=key_tile,
                               gathered=gathered, balanced=balanced)  # fmt: skip
    assert_attention_matches(attend, torch_fn, mesh, q, k, v, w)


@pytest.mark.parametrize(("gathered", "balanced", "window", "key_tile"), WINDOW_CASES)
def test_a_sliding_window_matches_torch_sdpa_with_the_banded_mask(gathered, balanced, window, key_tile):
    mesh = ts.make_mesh({"data": 2, "context": 4})
    g = torch.Generator().manual_seed(2)
    q, k, v, w = (torch.randn(4, heads, 512, 8, generator=g) for heads in (4, 2, 2, 4))
    band = torch.ones(512, 512, dtype=torch.bool).tril() & torch.ones(512, 512, dtype=torch.bool).triu(1 - window)

    def torch_fn(q, k, v):
        return (nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True) * w).sum()

    attend = functools.partial(context_attention, mesh=mesh, axis="context", causal=True, key_tile=key_tile,
                               gathered=gathered, balanced=balanced, window=window)  # fmt: skip
    assert_attention_matches(attend, torch_fn, mesh, q, k, v, w)


def test_balanced_layout_gives_every_device_equal_causal_work():
    def visible_pairs(layout, device):
        rows = [int(s) + i for s in layout.starts(device) for i in range(layout.run)]
        return sum(r + 1 for r in rows)  # causal: row r sees keys 0..r

    natural, balanced = SequenceLayout(64, 4, balanced=False), SequenceLayout(64, 4, balanced=True)
    assert len({visible_pairs(balanced, d) for d in range(4)}) == 1
    assert [visible_pairs(natural, d) for d in range(4)] == [136, 392, 648, 904]


# ---------------------------------------------------------------- all-to-all expert dispatch against a dense MoE

TOKENS, TOP_K = 32, 2
TOKEN_AXES = ("data", "expert")


def _routing():
    """Tokens, their top-k experts (most of them choose expert 0 first: device 0 is overloaded) and weights."""
    g = np.random.default_rng(0)
    logits = g.normal(size=(TOKENS, Experts.count))
    logits[:, 0] += 2.0
    index = np.argsort(-logits, axis=-1)[:, :TOP_K]
    x, weights = g.normal(size=(TOKENS, Experts.dim)), g.uniform(size=(TOKENS, TOP_K))
    return jnp.asarray(x, jnp.float32), jnp.asarray(index, jnp.int32), jnp.asarray(weights, jnp.float32)


def _kept(index: np.ndarray, shards: int, devices: int, capacity_factor: float | None) -> np.ndarray:
    """[T, k] which pairs fit: each token shard sends its pairs, in order, to the device of their expert, at
    most ``local · ceil(c · pairs / experts)`` of them to each device (all of them when dropless)."""
    local, kept = Experts.count // devices, np.ones(index.shape, bool)
    if capacity_factor is None:
        return kept
    for shard in np.split(np.arange(index.shape[0]), shards):
        pairs = len(shard) * index.shape[1]
        capacity = min(pairs, local * math.ceil(capacity_factor * pairs / Experts.count))
        sent = np.zeros(devices, int)
        for t in shard:
            for j, expert in enumerate(index[t]):
                kept[t, j] = sent[expert // local] < capacity
                sent[expert // local] += 1
    return kept


def _dense_moe(x, index, weights, up, down, kept):
    """Every token through each of its kept top-k experts, weighted by the router."""
    hidden = jax.nn.relu(jnp.einsum("td,tkhd->tkh", x, up[index]))
    out = jnp.einsum("tkh,tkdh->tkd", hidden, down[index])
    return (out * (weights * kept)[..., None]).sum(1)


@pytest.mark.parametrize(("capacity_factor", "dropped"), [(None, 0), (1.0, 23), (2.0, 4)])
def test_all_to_all_dispatch_matches_a_dense_moe_and_drops_pairs_over_capacity(capacity_factor, dropped):
    mesh = ts.make_mesh({"data": 2, "expert": 4})
    torch.manual_seed(0)
    module = Experts()
    where = experts.Experts("experts", module, "expert", ("up", "down"), Experts.count, TOKEN_AXES)
    dispatch = ts.ExpertDispatch(capacity_factor=capacity_factor)
    x, index, weights = _routing()
    params = [jnp.asarray(p.detach().numpy()) for p in (module.up, module.down)]
    kept = jnp.asarray(_kept(np.asarray(index), math.prod(mesh.shape[a] for a in TOKEN_AXES), 4, capacity_factor))
    readout = jnp.asarray(np.random.default_rng(1).normal(size=(TOKENS, Experts.dim)), jnp.float32)

    def moved(x, weights, up, down):
        out, lost = all_to_all._moved(where, dispatch, mesh, module.forward, x, index, weights, [up, down])
        return (out * readout).sum(), lost

    def dense(x, weights, up, down):
        return (_dense_moe(x, index, weights, up, down, kept) * readout).sum()

    with env():  # the module's own forward runs on torchax tensors for the local experts
        (value, lost), grads = jax.jit(jax.value_and_grad(moved, argnums=(0, 1, 2, 3), has_aux=True))(
            x, weights, *params
        )
    want, want_grads = jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2, 3)))(x, weights, *params)
    assert int(lost) == int((~kept).sum()) == dropped
    assert_close(value, want, what="value")
    _close_trees(grads, want_grads)
