"""torchshard's op lowerings (and torchax's for the same ops) match eager torch in value and gradient."""

import jax
import jax.numpy as jnp
import pytest
import torch
import torchax
import torchax.interop
from helpers import assert_close
from torch.nn import functional as F

from torchshard._torchax import wrap


def _inputs(seed: int, *shapes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen) for s in shapes]


def _ids(n: int, high: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed))


# name, scalar torch function, inputs, indices of the float inputs to differentiate
OPS = [
    ("matmul", lambda x, w: (x @ w).tanh().sum(), _inputs(0, (8, 16), (16, 4)), (0, 1)),
    ("softmax", lambda x, c: (F.softmax(x, dim=-1) * c).sum(), _inputs(1, (8, 16), (8, 16)), (0,)),
    (
        "layer_norm",
        lambda x, w, b, c: (F.layer_norm(x, (16,), w, b) * c).sum(),
        _inputs(2, (8, 16), (16,), (16,), (8, 16)),
        (0, 1, 2),
    ),
    ("embedding", lambda ids, w: F.embedding(ids, w).pow(2).sum(), [_ids(12, 10), *_inputs(3, (10, 6))], (1,)),
    (
        "cross_entropy",
        lambda logits, target: F.cross_entropy(logits, target),
        [*_inputs(4, (8, 10)), _ids(8, 10)],
        (0,),
    ),
    (
        "batched_matmul",
        lambda q, k: (q @ k.transpose(-2, -1)).tanh().sum(),
        _inputs(8, (2, 3, 4, 5), (2, 3, 6, 5)),
        (0, 1),
    ),
    (
        "attention_causal",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).sin().sum(),
        _inputs(9, (2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8)),
        (0, 1, 2),
    ),
    (
        "attention_gqa_scale",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True).sin().sum(),
        _inputs(10, (2, 4, 6, 8), (2, 2, 5, 8), (2, 2, 5, 8)),
        (0, 1, 2),
    ),
    (
        "attention_float_mask",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m).sin().sum(),
        _inputs(11, (2, 4, 6, 8), (2, 4, 5, 8), (2, 4, 5, 8), (6, 5)),
        (0, 1, 2),
    ),
    (
        "attention_bool_mask",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m > -0.5).sin().sum(),
        _inputs(12, (2, 4, 6, 8), (2, 4, 5, 8), (2, 4, 5, 8), (2, 1, 6, 5)),
        (0, 1, 2),
    ),
    (
        "cross_entropy_weight_ignore_index",
        lambda logits, w, target: F.cross_entropy(logits, target.masked_fill(target == 3, -100), weight=w.exp()),
        [*_inputs(13, (8, 10), (10,)), _ids(8, 10)],
        (0,),  # torch has no gradient for the class weights
    ),
    (
        "nll_loss_sum",
        lambda logits, target: F.nll_loss(F.log_softmax(logits, -1), target, reduction="sum"),
        [*_inputs(14, (8, 10)), _ids(8, 10)],
        (0,),
    ),
    (
        "nll_loss_none",
        lambda logits, target: F.nll_loss(F.log_softmax(logits, -1), target, reduction="none").sin().sum(),
        [*_inputs(15, (8, 10)), _ids(8, 10)],
        (0,),
    ),
    (
        "nll_loss_unbatched",
        lambda logits, target: F.nll_loss(F.log_softmax(logits, -1), target),
        [*_inputs(16, (10,)), _ids(8, 10)[3]],
        (0,),
    ),
    (
        "gather_dim1_smaller_index",
        lambda x, idx: torch.gather(x, 1, idx).pow(2).sum(),
        [*_inputs(5, (6, 5)), _ids(4 * 3, 5).reshape(4, 3)],
        (0,),
    ),
    (
        "gather_dim0",
        lambda x, idx: torch.gather(x, 0, idx).sin().sum(),
        [*_inputs(6, (5, 4)), _ids(7 * 4, 5).reshape(7, 4)],
        (0,),
    ),
    (
        "gather_3d_negative_dim",
        lambda x, idx: torch.gather(x, -1, idx).sum(),
        [*_inputs(7, (2, 3, 6)), _ids(2 * 3 * 2, 6).reshape(2, 3, 2)],
        (0,),
    ),
]


def _eager(fn, inputs, argnums):
    leaves = [t.clone().requires_grad_(i in argnums) for i, t in enumerate(inputs)]
    value = fn(*leaves)
    value.backward()
    return value.detach(), [leaves[i].grad for i in argnums]


def _on_jax(inputs):
    return [wrap(jnp.asarray(t.numpy())) for t in inputs]


@pytest.mark.parametrize(("name", "fn", "inputs", "argnums"), OPS, ids=[op[0] for op in OPS])
def test_op_in_torchax_env_matches_eager_torch(name, fn, inputs, argnums):
    expected, _ = _eager(fn, inputs, argnums)
    with torchax.default_env():
        value = fn(*_on_jax(inputs))
    assert_close(value, expected, what=name)


@pytest.mark.parametrize(("name", "fn", "inputs", "argnums"), OPS, ids=[op[0] for op in OPS])
def test_op_value_and_grad_matches_eager_torch(name, fn, inputs, argnums):
    expected, expected_grads = _eager(fn, inputs, argnums)
    value, grads = torchax.interop.jax_value_and_grad(fn, {"argnums": argnums})(*_on_jax(inputs))
    assert_close(value, expected, what=name)
    for i, grad, want in zip(argnums, grads, expected_grads, strict=True):
        assert_close(grad, want, what=f"{name} grad {i}")


@pytest.mark.parametrize(("name", "fn", "inputs", "argnums"), OPS, ids=[op[0] for op in OPS])
def test_jax_grad_of_torch_function_matches_eager_torch(name, fn, inputs, argnums):
    _, expected_grads = _eager(fn, inputs, argnums)
    arrays = [jnp.asarray(t.numpy()) for t in inputs]
    grads = jax.jit(jax.grad(torchax.interop.jax_view(fn), argnums=argnums))(*arrays)
    for i, grad, want in zip(argnums, grads, expected_grads, strict=True):
        assert_close(grad, want, what=f"{name} grad {i}")
