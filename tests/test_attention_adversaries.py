"""The attention kernel choice against calls that break a kernel's assumptions, through torchshard's lowering.

Every kernel that runs on the CPU (``tiled``, ``xla``, tokamax's XLA implementation where tokamax is
installed, and what ``auto`` picks) either matches eager torch's ``scaled_dot_product_attention``
(values and q/k/v gradients within 1e-5, `assert_close`) or, forced, refuses the call by name with
`ArgumentError`: never a different number. The calls are those real models make and a kernel could
get wrong: a causal mask over fewer or more queries than keys (torch aligns it top-left), finite
large-negative biases, a row that sees no key, masks of rank 2 and 3 that broadcast from the right,
one KV head without ``enable_gqa``, grouped heads with a per-head mask, a custom scale, values
narrower than queries (MLA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
import torchax.interop
from torch.nn import functional as F

from testsupport.helpers import TOKAMAX_NEEDS, assert_close, eager_value_and_grads
from torchshard import ArgumentError
from torchshard._bridge.env import env
from torchshard._bridge.ops import kernels


@pytest.fixture(autouse=True, scope="module")
def _torchshard_lowerings():
    env()


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _no_key_for_row_0(s: int, t: int) -> torch.Tensor:
    mask = torch.ones(s, t, dtype=torch.bool).tril()
    mask[0] = False
    return mask


LARGE_BIAS = _rand(2, 1, 6, 6, seed=9) * 1e4  # finite, far below every other score
PER_HEAD = _rand(2, 4, 6, 6, seed=5)
PADDING = torch.tensor([[True] * 7, [True] * 3 + [False] * 4])[:, None, None]  # [2, 1, 1, 7]: per batch entry

# name: (query, key, value shapes, attn_mask, is_causal, scale, enable_gqa)
CALLS = {
    "causal_fewer_queries": ((2, 4, 5, 8), (2, 4, 9, 8), (2, 4, 9, 8), None, True, None, False),
    "causal_more_queries": ((2, 4, 9, 8), (2, 4, 5, 8), (2, 4, 5, 8), None, True, None, False),
    "finite_negative_bias": ((2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8), LARGE_BIAS, False, None, False),
    "a_row_sees_no_key": ((2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8), _no_key_for_row_0(6, 6), False, None, False),
    "rank_3_mask_is_per_head": ((2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8), _rand(4, 6, 6, seed=3), False, None, False),
    "mask_broadcast_over_queries": ((2, 4, 6, 8), (2, 4, 7, 8), (2, 4, 7, 8), PADDING, False, None, False),
    "one_kv_head_without_enable_gqa": ((2, 4, 6, 8), (2, 1, 6, 8), (2, 1, 6, 8), None, True, None, False),
    "grouped_with_a_per_head_mask": ((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8), PER_HEAD, False, None, True),
    "custom_scale": ((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8), None, True, 0.3, True),
    "values_narrower_than_queries": ((2, 4, 6, 12), (2, 4, 6, 12), (2, 4, 6, 8), None, True, None, False),
}  # fmt: skip


def _attend(mask, causal, scale, gqa, weight):
    def fn(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        return (out * weight).sum()

    return fn


@pytest.mark.parametrize("kernel", ["auto", "tiled", "xla", "tokamax"])
@pytest.mark.parametrize("name", CALLS)
def test_a_kernel_matches_eager_sdpa_or_refuses_the_call_by_name(name, kernel):
    if kernel == "tokamax":
        pytest.importorskip("tokamax", reason=TOKAMAX_NEEDS)
    qs, ks, vs, mask, causal, scale, gqa = CALLS[name]
    q, k, v = _rand(*qs, seed=0), _rand(*ks, seed=1), _rand(*vs, seed=2)
    weight = _rand(*qs[:3], vs[-1], seed=4)
    fn = _attend(mask, causal, scale, gqa, weight)
    expected, expected_grads = eager_value_and_grads(fn, [q, k, v], argnums=(0, 1, 2))
    record: dict[str, kernels.Choice] = {}
    grad = jax.jit(jax.value_and_grad(torchax.interop.jax_view(fn), argnums=(0, 1, 2)))
    with kernels.choosing(kernels.Policy(kernel, "cpu", 1, record)):
        try:
            value, grads = grad(*(jnp.asarray(x.numpy()) for x in (q, k, v)))
        except ArgumentError as err:  # a forced kernel that cannot take the call says which and why
            assert kernel != "auto" and f"attention_kernel={kernel!r} cannot take" in str(err), err
            return
    if kernel == "tokamax":  # its own XLA implementation on the CPU, not a fallback
        assert {c.kernel for c in record.values()} == {"tokamax:xla"}, record
    assert_close(value, expected, what=f"{name} on {kernel} ({record})")
    for what, got, want in zip("qkv", grads, expected_grads, strict=True):
        assert_close(got, want, what=f"d{what}, {name} on {kernel} ({record})")
