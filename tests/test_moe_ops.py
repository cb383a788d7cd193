"""``aten._grouped_mm`` under torchax matches eager torch in value and gradient, in every form torch defines."""

import jax
import jax.numpy as jnp
import pytest
import torch
import torchax
import torchax.interop

from testsupport.helpers import assert_close, eager_value_and_grads, on_jax
from torchshard._bridge.env import env


@pytest.fixture(autouse=True, scope="module")
def _torchshard_lowerings():
    """torchax's default environment with torchshard's lowerings installed, whichever test runs first."""
    env()


# float32; the shared tolerance: |got - want| ≤ 1e-5 × max(1, max|want|)
TOL = 1e-5


def _offs(*ends: int) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)  # torch requires int32 cumulative end offsets


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rows(a, w, offs, c, *, transposed=False, rows=None):
    """2-D × 3-D, as transformers calls it; only rows below ``offs[-1]`` are defined (torch leaves the rest)."""
    b = w.transpose(-2, -1) if transposed else w
    out = torch._grouped_mm(a, b, offs=offs)
    return (out[:rows] * c[:rows]).sin().sum()


# name, scalar function, inputs (the int32 offsets among them), float inputs to differentiate,
# and the rows of input 0 whose gradient torch defines (None: all)
CASES = [
    (
        "2d_3d",
        lambda a, w, o, c: _rows(a, w, o, c),
        [_rand(0, 12, 8), _rand(1, 3, 8, 4), _offs(4, 8, 12), _rand(2, 12, 4)],
        (0, 1),
        None,
    ),
    (
        "2d_3d_empty_first_group",
        lambda a, w, o, c: _rows(a, w, o, c),
        [_rand(3, 12, 8), _rand(4, 3, 8, 4), _offs(0, 6, 12), _rand(5, 12, 4)],
        (0, 1),
        None,
    ),
    (
        "2d_3d_empty_middle_group",
        lambda a, w, o, c: _rows(a, w, o, c),
        [_rand(6, 12, 8), _rand(7, 3, 8, 4), _offs(5, 5, 12), _rand(8, 12, 4)],
        (0, 1),
        None,
    ),
    (
        "2d_3d_empty_last_group",
        lambda a, w, o, c: _rows(a, w, o, c),
        [_rand(9, 12, 8), _rand(10, 3, 8, 4), _offs(6, 12, 12), _rand(11, 12, 4)],
        (0, 1),
        None,
    ),
    (
        "2d_3d_one_group_has_all",
        lambda a, w, o, c: _rows(a, w, o, c),
        [_rand(12, 12, 8), _rand(13, 3, 8, 4), _offs(0, 12, 12), _rand(14, 12, 4)],
        (0, 1),
        None,
    ),
    (
        "2d_3d_rows_beyond_last_offset",  # as transformers' expert-parallel sentinels: rows 9..11 are undefined
        lambda a, w, o, c: _rows(a, w, o, c, rows=9),
        [_rand(15, 12, 8), _rand(16, 3, 8, 4), _offs(4, 6, 9), _rand(17, 12, 4)],
        (0, 1),
        9,
    ),
    (
        "2d_3d_transposed_view_weight",  # transformers passes gate_up_proj [E, out, in].transpose(-2, -1)
        lambda a, w, o, c: _rows(a, w, o, c, transposed=True),
        [_rand(18, 12, 8), _rand(19, 3, 4, 8), _offs(3, 3, 12), _rand(20, 12, 4)],
        (0, 1),
        None,
    ),
    (
        "2d_3d_moe_sized",
        lambda a, w, o, c: _rows(a, w, o, c, transposed=True),
        [_rand(21, 64, 32), _rand(22, 4, 64, 32), _offs(10, 10, 41, 64), _rand(23, 64, 64)],
        (0, 1),
        None,
    ),
    (
        "3d_2d",  # groups of b's columns
        lambda a, b, o, c: (torch._grouped_mm(a, b, offs=o) * c).sin().sum(),
        [_rand(24, 3, 6, 8), _rand(25, 8, 12), _offs(4, 4, 12), _rand(26, 6, 12)],
        (0, 1),
        None,
    ),
    (
        "2d_2d",  # groups of the contracting dim: the weight-gradient form, [G, M, N]
        lambda a, b, o, c: (torch._grouped_mm(a, b, offs=o) * c).sin().sum(),
        [_rand(27, 6, 12), _rand(28, 12, 8), _offs(4, 4, 12), _rand(29, 3, 6, 8)],
        (0, 1),
        None,
    ),
    (
        "3d_3d_batched",
        lambda a, b, c: (torch._grouped_mm(a, b) * c).sin().sum(),
        [_rand(30, 3, 8, 4), _rand(31, 3, 4, 8), _rand(32, 3, 8, 8)],
        (0, 1),
        None,
    ),
]
IDS = [case[0] for case in CASES]


def _defined(grad, i, rows):
    return grad[:rows] if i == 0 and rows is not None else grad


@pytest.mark.parametrize(("name", "fn", "inputs", "argnums", "rows"), CASES, ids=IDS)
def test_grouped_mm_value_and_grad_match_eager_torch(name, fn, inputs, argnums, rows):
    expected, expected_grads = eager_value_and_grads(fn, inputs, argnums)
    value, grads = torchax.interop.jax_value_and_grad(fn, {"argnums": argnums})(*on_jax(inputs))
    assert_close(value, expected, tol=TOL, what=name)
    for i, grad, want in zip(argnums, grads, expected_grads, strict=True):
        assert_close(_defined(grad.jax(), i, rows), _defined(want, i, rows), tol=TOL, what=f"{name} grad {i}")


@pytest.mark.parametrize(("name", "fn", "inputs", "argnums", "rows"), CASES, ids=IDS)
def test_grouped_mm_jitted_grad_matches_eager_torch(name, fn, inputs, argnums, rows):
    _, expected_grads = eager_value_and_grads(fn, inputs, argnums)
    grads = jax.jit(jax.grad(torchax.interop.jax_view(fn), argnums=argnums))(*[jnp.asarray(t.numpy()) for t in inputs])
    for i, grad, want in zip(argnums, grads, expected_grads, strict=True):
        assert_close(_defined(grad, i, rows), _defined(want, i, rows), tol=TOL, what=f"{name} grad {i}")


def test_empty_groups_get_exactly_zero_weight_gradient():
    inputs = [_rand(40, 12, 8), _rand(41, 3, 8, 4), _offs(0, 12, 12), _rand(42, 12, 4)]
    _, (grad,) = torchax.interop.jax_value_and_grad(_rows, {"argnums": (1,)})(*on_jax(inputs))
    assert float(jnp.abs(grad.jax()[0]).max()) == 0.0 and float(jnp.abs(grad.jax()[2]).max()) == 0.0


def test_rows_beyond_the_last_offset_are_zero():
    """torch leaves them uninitialised; here they are 0, which is what transformers' masking assumes at worst."""
    a, w, offs = on_jax([_rand(43, 12, 8), _rand(44, 3, 8, 4), _offs(4, 6, 9)])
    with torchax.default_env():
        out = torch._grouped_mm(a, w, offs=offs)
    assert float(jnp.abs(out.jax()[9:]).max()) == 0.0


def test_grouped_mm_vmapped_as_a_pipeline_runs_its_stages_matches_each_stage_alone():
    # JAX's CPU decomposition of a vmapped ragged_dot failed on numpy in_axes (_bridge/fixes/ragged_dot_dims.py)
    from torchshard._bridge.ops.grouped_mm import grouped_mm

    env()  # installs the lowerings (and the CPU fix)
    # [stages, data shards, ...]: a pipeline vmaps each stage's layer over both (one ragged batch dim each)
    a = jnp.stack([_rand(50 + i, 12, 8).numpy() for i in range(4)]).reshape(2, 2, 12, 8)
    w = jnp.stack([_rand(60 + i, 3, 8, 4).numpy() for i in range(4)]).reshape(2, 2, 3, 8, 4)
    offs = jnp.stack([_offs(4, 6, 12).numpy(), _offs(0, 9, 12).numpy()] * 2).reshape(2, 2, 3)

    def loss(a, w):
        return (jax.vmap(jax.vmap(grouped_mm))(a, w, offs) ** 2).sum()

    def alone(a, w):
        return sum((grouped_mm(a[i, j], w[i, j], offs[i, j]) ** 2).sum() for i in range(2) for j in range(2))

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(a, w)
    want, want_grads = jax.value_and_grad(alone, argnums=(0, 1))(a, w)
    assert_close(value, want, tol=TOL, what="value")
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected, tol=TOL, what="grad")


@pytest.mark.parametrize(
    ("a", "b", "kwargs", "match"),
    [
        (
            (12, 8),
            (3, 8, 4),
            {"bias": (3, 4), "with_offs": True},
            r"_grouped_mm\(\(12, 8\) × \(3, 8, 4\)\): bias is not supported",
        ),
        ((12, 8), (3, 8, 4), {}, r"offs is required when an operand is 2-D"),
        ((3, 8, 4), (3, 4, 8), {"offs": None, "with_offs": True}, r"not allowed when both are 3-D"),
        ((12,), (3, 12, 4), {"with_offs": True}, r"operands must be 2-D or 3-D, got 1-D × 3-D"),
    ],
)
def test_grouped_mm_errors_name_the_form(a, b, kwargs, match):
    kwargs = dict(kwargs)
    arrays = {"offs": _offs(4, 8, 12)} if kwargs.pop("with_offs", False) else {}
    arrays |= {k: torch.zeros(v) for k, v in kwargs.items() if v is not None}
    operands = on_jax([torch.zeros(a), torch.zeros(b)])
    with torchax.default_env(), pytest.raises(ValueError, match=match):
        torch._grouped_mm(*operands, **dict(zip(arrays, on_jax(list(arrays.values())), strict=True)))
