"""The tiled attention kernel (`_bridge/ops/flash.py`) against eager torch SDPA, values and gradients, many tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from torch.nn import functional as F

import torchshard as ts
from testsupport.helpers import assert_attention_matches, assert_close, eager_value_and_grads
from torchshard._bridge.ops import flash
from torchshard._bridge.ops.attention import attention_jax
from torchshard._strategies.context.ring_attention import context_attention

# (heads, kv_heads, seq, keys, causal, tiles): small tiles make several (query block, key tile) pairs
CASES = [
    (4, 4, 256, 256, True, (64, 64)),  # whole pairs scanned, diagonal pairs masked
    (4, 2, 256, 256, True, (32, 64)),  # grouped KV heads; blocks smaller than tiles: two cut pairs per tile
    (4, 1, 192, 192, True, (64, 32)),  # blocks larger than tiles
    (2, 2, 96, 160, True, (32, 32)),  # rectangular: torch's top-left causal mask, whole rows of keys hidden
    (4, 2, 128, 192, False, (32, 64)),  # no mask: every pair whole
    (2, 2, 64, 64, True, (64, 64)),  # one tile: no scan
]


@pytest.mark.parametrize(("heads", "kv_heads", "seq", "keys", "causal", "tiles"), CASES)
def test_tiled_attention_matches_torch_sdpa(heads, kv_heads, seq, keys, causal, tiles):
    mesh = ts.make_mesh({"data": 2, "context": 4})
    g = torch.Generator().manual_seed(seq + keys)
    shapes = [(2, heads, seq, 8), (2, kv_heads, keys, 8), (2, kv_heads, keys, 8), (2, heads, seq, 8)]
    q, k, v, w = (torch.randn(s, generator=g) for s in shapes)

    def torch_fn(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True) * w).sum()

    attend = lambda q, k, v: attention_jax(q, k, v, None, causal, None, tiles=tiles)  # noqa: E731
    assert_attention_matches(attend, torch_fn, mesh, q, k, v, w)


@pytest.mark.parametrize(("causal", "tiles"), [(True, (32, 64)), (False, (64, 64))])
def test_a_value_head_dim_other_than_the_querys_matches_torch_sdpa(causal, tiles):
    # multi-head latent attention (DeepSeek-V3: queries and keys 192 wide, values 128), here 12 against 8
    mesh = ts.make_mesh({"data": 2, "context": 4})
    g = torch.Generator().manual_seed(5)
    shapes = [(2, 4, 128, 12), (2, 2, 128, 12), (2, 2, 128, 8), (2, 4, 128, 8)]
    q, k, v, w = (torch.randn(s, generator=g) for s in shapes)

    def torch_fn(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True) * w).sum()

    attend = lambda q, k, v: attention_jax(q, k, v, None, causal, None, tiles=tiles)  # noqa: E731
    assert_attention_matches(attend, torch_fn, mesh, q, k, v, w)


def _masks(kind: str, g: torch.Generator) -> torch.Tensor:
    """Masks over [2, 4 heads, 96 queries, 128 keys] (or broadcast to it); rows 5 and 70 see no key."""
    blocked = torch.ones(96, 128, dtype=torch.bool)
    blocked[[5, 70]] = False
    if kind == "bool_per_head":
        return (torch.rand(2, 4, 96, 128, generator=g) > 0.3) & blocked
    if kind == "bool_padding":  # [b, 1, 1, t]: keys of the padding
        return (torch.arange(128) < torch.tensor([[100], [128]]))[:, None, None]
    bias = torch.randn(4, 96, 128, generator=g)
    if kind == "float_per_head_3d":
        return bias.masked_fill(~blocked, -torch.inf)
    return torch.randn(2, 1, 1, 128, generator=g).masked_fill(torch.arange(128) >= 120, -torch.inf)  # float_padding


@pytest.mark.parametrize("kind", ["bool_per_head", "bool_padding", "float_per_head_3d", "float_padding"])
def test_tiled_attention_with_masks_matches_torch_sdpa(kind):
    mesh = ts.make_mesh({"data": 2, "context": 4})
    g = torch.Generator().manual_seed(7)
    q, w = torch.randn(2, 4, 96, 8, generator=g), torch.randn(2, 4, 96, 8, generator=g)
    k, v = torch.randn(2, 2, 128, 8, generator=g), torch.randn(2, 2, 128, 8, generator=g)
    mask = _masks(kind, g)

    def torch_fn(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True) * w).sum()

    m = jnp.asarray(mask.numpy())
    attend = lambda q, k, v: attention_jax(q, k, v, m, False, None, tiles=(32, 32))  # noqa: E731
    assert_attention_matches(attend, torch_fn, mesh, q, k, v, w)


@pytest.mark.parametrize("shape", [(4, 96, 128), (2, 1, 1, 128), (1, 1, 96, 1)], ids=["per_head", "keys", "rows"])
def test_gradient_of_a_float_bias_matches_torch(shape):
    """A learned bias (relative positions, ALiBi slopes) gets torch's gradient, summed over its broadcast dims."""
    g = torch.Generator().manual_seed(11)
    q, w = torch.randn(2, 4, 96, 8, generator=g), torch.randn(2, 4, 96, 8, generator=g)
    k, v = torch.randn(2, 4, 128, 8, generator=g), torch.randn(2, 4, 128, 8, generator=g)
    bias = torch.randn(*shape, generator=g)
    fn = lambda q, k, v, bias: (F.scaled_dot_product_attention(q, k, v, attn_mask=bias) * w).sum()  # noqa: E731
    expected, expected_grads = eager_value_and_grads(fn, [q, k, v, bias], argnums=(0, 1, 2, 3))
    arrays = [jnp.asarray(t.numpy()) for t in (q, k, v, bias)]
    loss = lambda q, k, v, b: (attention_jax(q, k, v, b, False, None, tiles=(32, 64)) * w.numpy()).sum()  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*arrays)
    assert_close(value, expected, what="value")
    for name, got, want in zip(["dq", "dk", "dv", "dbias"], grads, expected_grads, strict=True):
        assert_close(got, want, what=name)


def test_bf16_tiles_match_float32_torch():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 256, 8, generator=g).bfloat16() for _ in range(3))
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    got = attention_jax(*(jnp.asarray(t.float().numpy()).astype(jnp.bfloat16) for t in (q, k, v)), None, True, None,
                        tiles=(64, 64))  # fmt: skip
    assert got.dtype == jnp.bfloat16
    assert_close(got, expected, tol=2e-2, what="bf16 attention")


def _ring(q, k, v):
    mesh = jax.sharding.get_abstract_mesh()
    return context_attention(q, k, v, mesh=mesh, axis="context", causal=True, balanced=True)


@pytest.mark.parametrize(
    "attend",
    [lambda q, k, v: attention_jax(q, k, v, None, True, None), _ring],
    ids=["flash", "ring"],
)
@pytest.mark.parametrize("policy", ["dots_saveable", "everything_saveable"])
def test_no_remat_policy_saves_the_scores(attend, policy):
    """``dots_saveable`` may keep matmul outputs: the scores are inside a custom VJP, so there are none to keep.

    Without ``optimize_remat`` JAX replayed the kernel's forward for its output, keeping every tile's
    scores to do so: 154 MiB here (flash) where one score matrix is 256 MiB.
    """
    seq = 4096
    q = jax.ShapeDtypeStruct((1, 4, seq, 16), jnp.float32)
    loss = jax.checkpoint(lambda q: attend(q, q, q).sum(), policy=getattr(jax.checkpoint_policies, policy))
    with jax.set_mesh(ts.make_mesh({"context": 2}, devices=jax.devices()[:2])):
        temp = jax.jit(jax.grad(loss)).lower(q).compile().memory_analysis().temp_size_in_bytes
    assert temp < 4 * seq * seq * 4 / 4  # a quarter of one f32 score matrix per head


def test_costs_count_what_tiles_pass_among_themselves_apart():
    """A fused flash kernel keeps a tile's scores on chip: the estimate counts them apart from the memory traffic."""
    from torchshard._hlo.costs import step_costs

    seq, tile = 1024, flash.tile_size(1024)
    q = jax.ShapeDtypeStruct((1, 4, seq, 16), jnp.float32)
    costs = step_costs(jax.jit(jax.grad(lambda q: attention_jax(q, q, q, None, True, None).sum())).lower(q).compile()
                       .as_text())  # fmt: skip
    whole, cut = flash.Tiling(tile, tile, causal=True).pairs(seq, seq)
    scores = (len(whole) + len(cut)) * 4 * tile * tile * 4  # every visible tile's f32 scores, once
    assert costs.tile_bytes > 3 * scores  # written and read back, forward and backward
    assert costs.bytes_accessed < costs.tile_bytes / 2
    assert costs.flops == 7 * (len(whole) + len(cut)) * 2 * 4 * tile * tile * 16


def test_tile_pairs_skip_what_the_causal_mask_hides():
    whole, cut = flash.Tiling(64, 32, causal=True).pairs(128, 128)
    assert cut == ((0, 0), (0, 1), (1, 2), (1, 3))  # each block's diagonal keys
    assert whole == ((1, 0), (1, 1))
    assert flash.Tiling(32, 32, causal=True).pairs(64, 128) == (((1, 0),), ((0, 0), (1, 1)))
    assert flash.Tiling(32, 32, causal=False).pairs(64, 64) == (((0, 0), (0, 1), (1, 0), (1, 1)), ())


@pytest.mark.parametrize(
    ("length", "tile"), [(8192, 512), (4096, 256), (2048, 128), (256, 64), (100, 100), (6, 6), (0, 1)]
)
def test_tile_size(length, tile):
    assert flash.tile_size(length) == tile


@pytest.mark.slow
@pytest.mark.parametrize(
    "attend",
    [lambda q, k, v: attention_jax(q, k, v, None, True, None), _ring],
    ids=["flash", "ring"],
)
def test_a_scanned_checkpoint_keeps_no_mask_per_tile(attend):
    """Under ``scan_layers`` + ``nothing_saveable`` the step keeps no more than with no remat at all.

    The masks were ``jnp.where`` broadcasts to the scores' full shape, loop-invariant, so JAX saved
    them as residuals of the layer scan, one per ring step and tile: a 2-layer Llama at 4k tokens on
    4 context devices compiled to 481 MiB under remat against 359 MiB without it (148 MiB on FSDP).
    """
    seq, heads, dim = 2048, 4, 16
    x = jax.ShapeDtypeStruct((4, seq, heads * dim), jnp.float32)
    ws = jax.ShapeDtypeStruct((2, heads * dim, heads * dim), jnp.float32)

    def layer(x, w):
        q = (x @ w).reshape(*x.shape[:2], heads, dim).transpose(0, 2, 1, 3)
        return x + attend(q, q, q).transpose(0, 2, 1, 3).reshape(x.shape)

    def temp(policy):
        body = jax.checkpoint(layer, policy=getattr(jax.checkpoint_policies, policy))
        loss = lambda ws, x: jax.lax.scan(lambda x, w: (body(x, w), None), x, ws)[0].sum()  # noqa: E731
        with jax.set_mesh(ts.make_mesh({"context": 2}, devices=jax.devices()[:2])):
            compiled = jax.jit(jax.grad(loss)).lower(ws, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp("nothing_saveable") <= temp("everything_saveable")
