"""torchshard's op lowerings (and torchax's for the same ops) match eager torch in value and gradient."""

import contextlib
import copy
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchax
import torchax.interop
from torch.nn import functional as F

from testsupport.helpers import assert_close, eager_value_and_grads, on_jax
from torchshard._bridge.env import env
from torchshard._bridge.tensors import wrap


@pytest.fixture(autouse=True, scope="module")
def _torchshard_lowerings():
    """torchax's default environment with torchshard's lowerings installed, whichever test runs first."""
    env()


def _inputs(seed: int, *shapes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen) for s in shapes]


def _ids(n: int, high: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed))


def _k_step_grad(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """HRM's recurrence (transformers' hrm_text): early cycles under no_grad pass no gradient back."""
    h = x
    with torch.no_grad():
        h = torch.tanh(h @ w + x)
    h = torch.tanh(h @ w + x)
    return h.square().sum()


class _Gelu(torch.autograd.Function):
    """A custom Function, as transformers' Bloom GELU: torch runs its forward with grad mode off."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


def _seen_rows(m: torch.Tensor) -> torch.Tensor:
    """Query rows 0 and 3 of 6 may attend to nothing (as left padding's rows): False there."""
    return torch.arange(6, device=m.device)[:, None] % 3 != 0


# name, scalar torch function, inputs, indices of the float inputs to differentiate
OPS = [
    ("no_grad_block", _k_step_grad, _inputs(8, (8, 16), (16, 16)), (0, 1)),
    # depthwise conv1d (Mamba's and linear attention's short causal conv): shifted sums; others: torchax's conv
    (
        "depthwise_conv1d_causal",
        lambda x, w, b: F.conv1d(x, w, b, padding=3, groups=8)[..., :10].sin().sum(),
        _inputs(10, (2, 8, 10), (8, 1, 4), (8,)),
        (0, 1, 2),
    ),
    (
        "depthwise_conv1d_dilated_unbatched",
        lambda x, w: F.conv1d(x, w, padding=2, dilation=2, groups=8).tanh().sum(),
        _inputs(11, (8, 9), (8, 1, 3)),
        (0, 1),
    ),
    # gated delta-rule chunks (qwen3_next, olmo_hybrid): blocked substitution on CPU, not LAPACK's trsm
    (
        "solve_triangular_unit_lower_broadcast",
        lambda a, b: torch.linalg.solve_triangular(0.3 * a, b, upper=False, unitriangular=True).sin().sum(),
        _inputs(24, (2, 1, 20, 20), (2, 3, 20, 5)),
        (0, 1),
    ),
    (
        "solve_triangular_upper_right",
        lambda a, b: torch.linalg.solve_triangular(a + 4 * torch.eye(11), b, upper=True, left=False).tanh().sum(),
        _inputs(25, (11, 11), (3, 6, 11)),
        (0, 1),
    ),
    ("grouped_conv1d", lambda x, w: F.conv1d(x, w, groups=2).sin().sum(), _inputs(12, (2, 8, 10), (4, 4, 3)), (0, 1)),
    # a Function's forward runs with grad mode off, yet passes gradients (not a no_grad region)
    ("autograd_function", lambda x, w: _Gelu.apply(x @ w).square().sum(), _inputs(9, (8, 16), (16, 4)), (0, 1)),
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
        "embedding_padding_idx",
        lambda ids, w: F.embedding(ids, w, padding_idx=2).pow(2).sum(),
        [_ids(12, 10), *_inputs(5, (10, 6))],
        (1,),
    ),
    (
        "embedding_negative_padding_idx",
        lambda ids, w: F.embedding(ids, w, padding_idx=-3).sin().sum(),
        [_ids(12, 10), *_inputs(6, (10, 6))],
        (1,),
    ),
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
    (  # query rows that see no key (left padding's rows): torch's SDPA gives them zeros
        "attention_bool_mask_blocked_rows",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=(m > -0.5) & _seen_rows(m)).sin().sum(),
        _inputs(13, (2, 4, 6, 8), (2, 4, 5, 8), (2, 4, 5, 8), (2, 1, 6, 5)),
        (0, 1, 2),
    ),
    (
        "attention_float_mask_blocked_rows",
        lambda q, k, v, m: (
            F.scaled_dot_product_attention(q, k, v, attn_mask=m.masked_fill(~_seen_rows(m), -torch.inf)).sin().sum()
        ),
        _inputs(14, (2, 4, 6, 8), (2, 4, 5, 8), (2, 4, 5, 8), (2, 1, 6, 5)),
        (0, 1, 2),
    ),
    (  # one key head broadcast over the query heads without enable_gqa: Falcon's multi-query attention
        "attention_one_key_head_blocked_rows",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=(m > -0.5) & _seen_rows(m)).sin().sum(),
        _inputs(29, (2, 4, 6, 8), (2, 1, 5, 8), (2, 1, 5, 8), (2, 1, 6, 5)),
        (0, 1, 2),
    ),
    (  # no head dim: torchax's own attention, whose softmax over no key gives NaN where torch gives zeros
        "attention_3d_blocked_rows",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=(m > -0.5) & _seen_rows(m)).sin().sum(),
        _inputs(30, (4, 6, 8), (4, 5, 8), (4, 5, 8), (1, 6, 5)),
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
        "linear_3d_bias",
        lambda x, w, b: F.linear(x, w, b).tanh().sum(),
        _inputs(17, (2, 5, 16), (12, 16), (12,)),
        (0, 1, 2),
    ),
    ("linear_1d_input", lambda x, w: F.linear(x, w).sin().sum(), _inputs(18, (16,), (12, 16)), (0, 1)),
    ("linear_4d_wide", lambda x, w: F.linear(x, w).sin().sum(), _inputs(19, (2, 3, 4, 8), (40, 8)), (0, 1)),
    ("linear_module", lambda x, w, b: nn_linear(x, w, b).cos().sum(), _inputs(20, (3, 7, 8), (5, 8), (5,)), (0, 1, 2)),
    ("matmul_3d_by_2d", lambda x, w: (x @ w).tanh().sum(), _inputs(21, (2, 5, 16), (16, 6)), (0, 1)),
    (
        "cross_entropy_sum_ignore_index",
        lambda logits, target: F.cross_entropy(logits, target.masked_fill(target == 3, -100), reduction="sum"),
        [*_inputs(22, (9, 10)), _ids(9, 10)],
        (0,),
    ),
    (
        "cross_entropy_mean_ignore_index",
        lambda logits, target: F.cross_entropy(logits * 3, target.masked_fill(target < 3, 7), ignore_index=7),
        [*_inputs(23, (9, 10)), _ids(9, 10)],
        (0,),
    ),
    (
        "cross_entropy_label_smoothing",  # torch's decomposition
        lambda logits, target: F.cross_entropy(logits, target, label_smoothing=0.1),
        [*_inputs(25, (9, 10)), _ids(9, 10)],
        (0,),
    ),
    (
        "cross_entropy_none",  # torch's decomposition
        lambda logits, target: F.cross_entropy(logits, target, reduction="none").sin().sum(),
        [*_inputs(26, (9, 10)), _ids(9, 10)],
        (0,),
    ),
    (
        "cross_entropy_spatial",  # [N, C, d]: torch's decomposition
        lambda logits, target: F.cross_entropy(logits, target.reshape(3, 3)),
        [*_inputs(27, (3, 10, 3)), _ids(9, 10)],
        (0,),
    ),
    (
        "cross_entropy_probabilities",  # float targets: torch's decomposition
        lambda logits, target: F.cross_entropy(logits, target.softmax(-1)),
        _inputs(28, (9, 10), (9, 10)),
        (0,),
    ),
    (
        "attention_causal_2_blocks",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).sin().sum(),
        _inputs(29, (2, 2, 128, 8), (2, 2, 128, 8), (2, 2, 128, 8)),
        (0, 1, 2),
    ),
    (
        "attention_gqa_causal_4_blocks_scale",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True).sin().sum(),
        _inputs(30, (1, 4, 256, 8), (1, 2, 256, 8), (1, 2, 256, 8)),
        (0, 1, 2),
    ),
    (
        "attention_causal_rectangular",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).sin().sum(),
        _inputs(31, (2, 4, 6, 8), (2, 4, 9, 8), (2, 4, 9, 8)),
        (0, 1, 2),
    ),
    (
        "attention_gqa_per_head_bool_mask",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m > -0.8, enable_gqa=True).sin().sum(),
        _inputs(32, (2, 4, 6, 8), (2, 2, 5, 8), (2, 2, 5, 8), (2, 4, 6, 5)),
        (0, 1, 2),
    ),
    (
        "attention_gqa_float_mask_3d",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True).sin().sum(),
        _inputs(33, (2, 4, 6, 8), (2, 1, 5, 8), (2, 1, 5, 8), (4, 6, 5)),
        (0, 1, 2),
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


def nn_linear(x, w, b):
    """An nn.Linear module with these weights (its forward calls F.linear)."""
    layer = torch.nn.Linear(w.shape[1], w.shape[0])
    return torch.func.functional_call(layer, {"weight": w, "bias": b}, (x,))


@pytest.mark.parametrize(("name", "fn", "inputs", "argnums"), OPS, ids=[op[0] for op in OPS])
def test_op_in_torchax_env_matches_eager_torch(name, fn, inputs, argnums):
    expected, _ = eager_value_and_grads(fn, inputs, argnums)
    with torchax.default_env():
        value = fn(*on_jax(inputs))
    assert_close(value, expected, what=name)


# op by op, outside jit, these compile one small program per op of a blocked loop or a solve: each over ~1.5 s
SLOW_EAGER = {"solve_triangular_upper_right", "solve_triangular_unit_lower_broadcast", "attention_causal",
              "attention_causal_2_blocks", "attention_gqa_scale", "attention_one_key_head_blocked_rows"}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "fn", "inputs", "argnums"),
    [pytest.param(*op, marks=pytest.mark.slow if op[0] in SLOW_EAGER else (), id=op[0]) for op in OPS],
)
def test_op_value_and_grad_matches_eager_torch(name, fn, inputs, argnums):
    expected, expected_grads = eager_value_and_grads(fn, inputs, argnums)
    value, grads = torchax.interop.jax_value_and_grad(fn, {"argnums": argnums})(*on_jax(inputs))
    assert_close(value, expected, what=name)
    for i, grad, want in zip(argnums, grads, expected_grads, strict=True):
        assert_close(grad, want, what=f"{name} grad {i}")


@pytest.mark.parametrize(("name", "fn", "inputs", "argnums"), OPS, ids=[op[0] for op in OPS])
def test_jax_grad_of_torch_function_matches_eager_torch(name, fn, inputs, argnums):
    _, expected_grads = eager_value_and_grads(fn, inputs, argnums)
    arrays = [jnp.asarray(t.numpy()) for t in inputs]
    grads = jax.jit(jax.grad(torchax.interop.jax_view(fn), argnums=argnums))(*arrays)
    for i, grad, want in zip(argnums, grads, expected_grads, strict=True):
        assert_close(grad, want, what=f"{name} grad {i}")


def test_cross_entropy_legacy_reduction_arguments_match_torch():
    logits, target = *_inputs(24, (9, 10)), _ids(9, 10)
    with pytest.warns(UserWarning, match="size_average"):
        expected = F.cross_entropy(logits, target, size_average=False)
    with torchax.default_env(), pytest.warns(UserWarning, match="size_average"):
        got = F.cross_entropy(*on_jax([logits, target]), size_average=False)
    assert_close(got, expected, what="cross_entropy(size_average=False)")


# bf16 inputs against eager float32 torch on the same (bf16-rounded) values; bf16 keeps 8 mantissa bits
BF16_TOL = 2e-2
BF16_OPS = {
    "linear": (lambda x, w: F.linear(x, w), _inputs(40, (2, 6, 16), (12, 16))),
    "attention_gqa_causal_2_blocks": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        _inputs(41, (1, 4, 128, 8), (1, 2, 128, 8), (1, 2, 128, 8)),
    ),
    "attention_bool_mask": (
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m > -0.5),
        _inputs(42, (2, 4, 6, 8), (2, 4, 5, 8), (2, 4, 5, 8), (2, 1, 6, 5)),
    ),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t), [*_inputs(43, (9, 10)), _ids(9, 10)]),
}


@pytest.mark.parametrize("name", BF16_OPS)
def test_bf16_inputs_match_float32_torch(name):
    fn, inputs = BF16_OPS[name]
    rounded = [t.bfloat16() if t.is_floating_point() else t for t in inputs]
    expected = fn(*[t.float() if t.is_floating_point() else t for t in rounded])
    arrays = [jnp.asarray(t.float().numpy()).astype(jnp.bfloat16) if t.is_floating_point() else jnp.asarray(t.numpy())
              for t in rounded]  # fmt: skip
    with torchax.default_env():
        got = fn(*[wrap(a) for a in arrays])
    assert got.jax().dtype == jnp.bfloat16
    assert_close(got, expected, tol=BF16_TOL, what=f"{name} (bf16)")


def _llama(seq: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("mesh_axes", [None, {"data": 4, "model": 2}], ids=["unsharded", "hf_rules_4x2"])
@pytest.mark.slow
def test_hf_llama_loss_and_grads_match_eager_torch(mesh_axes):
    """Every lowering at once (linear, blocked causal GQA attention, fused cross entropy), sharded or not."""
    import torchshard as ts

    seq = 128  # two causal query blocks
    model = _llama(seq)
    ids = torch.randint(0, 96, (4, seq), generator=torch.Generator().manual_seed(3))
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    mesh = ts.make_mesh(mesh_axes) if mesh_axes else None
    sharded = ts.shard(model, ts.plan(model, mesh or ts.make_mesh({"data": 1}, devices=jax.devices()[:1]),
                                      ts.presets.hf_rules(model) if mesh else None))  # fmt: skip
    params = {n: p.jax() for n, p in sharded.named_parameters()}
    placed = ts.shard_batch(ids, mesh) if mesh else wrap(jnp.asarray(ids.numpy()))

    def loss(arrays):
        with torchax.default_env():
            tensors = {n: wrap(a) for n, a in arrays.items()}
            out = torch.func.functional_call(sharded, tensors, (), {"input_ids": placed, "labels": placed})
            return out.loss.jax()

    with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert_close(value, expected.detach(), what="loss")
    for name, grad in grads.items():
        assert_close(grad, want[name], what=f"grad of {name}")


def test_padding_row_of_a_vocabulary_sharded_embedding_is_the_only_row_without_gradient():
    """torchax zeroed local row 0 of every shard of an FSDP-sharded table: rows 16, 32, ... never trained."""
    import optax

    import torchshard as ts

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Embedding(128, 16, padding_idx=0), torch.nn.Linear(16, 128))
    model = copy.deepcopy(ref)
    ids = torch.arange(128).reshape(8, 16)  # every row, padding and shard boundaries included

    def loss_fn(m, ids):
        return F.cross_entropy(m(ids).reshape(-1, 128), ids.reshape(-1).flip(0))

    torch.optim.SGD(ref.parameters(), lr=1.0).zero_grad()
    loss_fn(ref, ids).backward()
    with torch.no_grad():
        ref[0].weight -= ref[0].weight.grad
    mesh = ts.make_mesh({"data": 8})
    trainer = ts.Trainer(model, loss_fn, optax.sgd(1.0), ts.plan(model, mesh, [(r"0\.weight", ("data", None))]))
    trainer.step(ids)
    assert_close(ts.to_torch_state_dict(trainer)["0.weight"], ref[0].weight, what="embedding after one SGD step")


# torch's runtime assertions: (name, call on a tensor x of ones(4)); each run eagerly in torch and under torchax
ASSERTS = {
    "assert_async": lambda x: torch._assert_async(x.sum() > 0),
    "assert_async_false": lambda x: torch._assert_async(x.sum() < 0),
    "assert_async_many": lambda x: torch._assert_async(x > 0),
    "assert_async_msg": lambda x: torch._assert_async(x.sum() > 0, "positive"),
    "assert_async_msg_false": lambda x: torch._assert_async(x.sum() < 0, "negative"),
    "functional_false": lambda x: torch.ops.aten._functional_assert_async.msg(
        x.sum() < 0, "functional", torch.ops.aten._make_dep_token()
    ),
    # torch._check_tensor_all (blt's byte patcher): `aten._is_all_true`, then `.item()`
    "check_tensor_all": lambda x: torch._check_tensor_all(x > 0),
    "check_tensor_all_false": lambda x: torch._check_tensor_all(x < 0, lambda: "all negative"),
    "assert_scalar_false": lambda x: torch.ops.aten._assert_scalar(x.shape[0] == 3, "three rows"),
    "tensor_metadata": lambda x: torch.ops.aten._assert_tensor_metadata(x, [4], None, torch.float32),
    "tensor_metadata_size": lambda x: torch.ops.aten._assert_tensor_metadata(x, [3], None, torch.float32),
    "constrain": lambda x: torch.ops.aten.sym_constrain_range(x.shape[0], min=0, max=8),
    "constrain_out": lambda x: torch.ops.aten.sym_constrain_range(x.shape[0], min=0, max=2),
    "constrain_for_size_out": lambda x: torch.ops.aten.sym_constrain_range_for_size(x.shape[0], min=5, max=8),
    "functional_constrain_out": lambda x: torch.ops.aten._functional_sym_constrain_range(
        x.shape[0], 0, 2, torch.ops.aten._make_dep_token()
    ),
}


def _outcome(call, x):
    try:
        call(x)
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    return "ok"


@pytest.mark.parametrize("name", ASSERTS)
def test_runtime_assertions_check_known_values_as_torch_does(name):
    expected = _outcome(ASSERTS[name], torch.ones(4))
    with torchax.default_env():
        assert _outcome(ASSERTS[name], torch.ones(4, device="jax")) == expected


def test_a_traced_condition_is_dropped_and_prints_run_every_call(capfd):
    def checked(x):
        torch._assert_async(x.sum() < 0, "negative")  # traced: no value to check inside jit
        torch._check_tensor_all(x < 0)
        torch.ops.aten._print("printed")
        return x * 2

    jitted = torchax.interop.jax_jit(checked)
    with torchax.default_env():
        for _ in range(2):
            assert_close(jitted(torch.ones(4, device="jax")), 2 * torch.ones(4))
    jax.effects_barrier()
    assert capfd.readouterr().out == "printed\nprinted\n"


class ShapeChecked(torch.nn.Module):
    """torchtitan's RoPE checks the rotary table against the sequence with ``torch._assert_async``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("table", torch.ones(8, 16))

    def forward(self, x):
        torch._assert_async(torch.tensor(self.table.shape[0] >= x.shape[1]), "rotary table shorter than sequence")
        return self.lin(x) * self.table[: x.shape[1]]


def test_a_model_asserting_with_assert_async_trains_like_torch():
    import optax

    import torchshard as ts
    from testsupport.helpers import torch_losses

    torch.manual_seed(0)
    reference = ShapeChecked()
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    batches = _inputs(3, (8, 4, 16), (8, 4, 16))
    model = copy.deepcopy(reference)
    trainer = ts.Trainer(model, loss, optax.sgd(0.1), ts.plan(model, ts.make_mesh({"data": 8})))
    got = [float(trainer.step(b)["loss"]) for b in batches]
    expected = torch_losses(reference, loss, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    assert_close(torch.tensor(got), torch.tensor(expected), tol=1e-5, what="losses")
    with torchax.default_env(), pytest.raises(RuntimeError, match="rotary table shorter than sequence"):
        trainer.model(ts.shard_batch(torch.ones(8, 9, 16), trainer.mesh))  # eager: the condition has a value


def test_set_of_a_tensor_onto_itself_is_a_no_op_as_in_torch():
    """``register_parametrization`` calls it (peft's LoRA on stacked MoE experts, every forward)."""
    (a,) = on_jax(_inputs(0, (2, 3)))
    with env():
        assert a.set_(a) is a
    np_a = np.asarray(a.jax())
    np.testing.assert_array_equal(np_a, _inputs(0, (2, 3))[0].numpy())


def test_set_onto_another_tensor_is_refused_naming_the_fix():
    from torchshard._base.errors import ShardingError

    a, b = on_jax(_inputs(0, (2, 3), (3,)))
    with env(), pytest.raises(ShardingError, match=r"set_\(source\) of a \(2, 3\) tensor onto another \(3,\) tensor"):
        a.set_(b)


@pytest.mark.slow
def test_a_triangular_solve_on_cpu_calls_no_lapack_kernel():
    """LAPACK's trsm splits its batch over the pool the simulated devices run on: eight devices
    entering it at once wait on each other for ever (qwen3_next's first step hung). The compiled
    step, gradient included, is matmuls and slices."""
    a, b = _inputs(26, (4, 2, 64, 64), (4, 2, 64, 8))

    def solved(a, b):
        return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True).square().sum()

    arrays = [jnp.asarray(t.numpy()) for t in (a, b)]
    hlo = jax.jit(jax.grad(torchax.interop.jax_view(solved), argnums=(0, 1))).lower(*arrays).compile().as_text()
    assert "trsm" not in hlo, "the solve still calls LAPACK"
