"""init_sharded builds exactly what ``model_fn()`` builds: every ``torch.nn.init`` function, writes through views,
padding rows, transformers' ``_init_weights`` and a torchtitan-style ``init_weights``.

Deterministic values must equal eager torch exactly; random ones (JAX's RNG, not torch's) must keep
their defining property: bounds, spread, orthogonality, sparsity.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import torchshard as ts
from testsupport.helpers import to_numpy
from torchshard import ShardingError, presets

RULES = presets.fsdp(min_size=1)  # every tensor with a dim divisible by 8 is sharded


@pytest.fixture(scope="module")
def mesh():
    return ts.make_mesh({"data": 8})


def _built(model_fn: Callable[[], nn.Module], mesh, *, seed: int = 0) -> tuple[nn.Module, dict, dict]:
    """model_fn() built by init_sharded, its values and eager torch's values ({name: float64 numpy})."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated nn.init aliases say so
        model = ts.init_sharded(model_fn, mesh, RULES, seed=seed)
        torch.manual_seed(seed)
        eager = model_fn()
    return model, _values(model), _values(eager)


def _values(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: to_numpy(t) for name, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()}


# --- every public torch.nn.init function -------------------------------------------------------------


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    field = math.prod(shape[2:])
    return shape[1] * field, shape[0] * field


def _spread(mean: float, std: float) -> Callable[[np.ndarray], None]:
    def check(w: np.ndarray) -> None:
        tol = 4 * std / math.sqrt(w.size)  # 4 standard errors
        assert abs(w.mean() - mean) < tol, (w.mean(), mean)
        assert abs(w.std() / std - 1) < 0.1, (w.std(), std)

    return check


def _within(low: float, high: float, mean: float, std: float) -> Callable[[np.ndarray], None]:
    def check(w: np.ndarray) -> None:
        assert low <= w.min() and w.max() <= high, (w.min(), w.max(), low, high)
        _spread(mean, std)(w)

    return check


def _truncated_normal_moments(mean: float, std: float, a: float, b: float) -> tuple[float, float]:
    """Mean and standard deviation of N(mean, std²) truncated to [a, b]."""
    alpha, beta = (a - mean) / std, (b - mean) / std
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: (1 + math.erf(x / math.sqrt(2))) / 2  # noqa: E731
    z = cdf(beta) - cdf(alpha)
    shift = (pdf(alpha) - pdf(beta)) / z
    var = 1 + (alpha * pdf(alpha) - beta * pdf(beta)) / z - shift**2
    return mean + std * shift, std * math.sqrt(var)


def _orthogonal(gain: float) -> Callable[[np.ndarray], None]:
    def check(w: np.ndarray) -> None:
        flat = w.reshape(w.shape[0], -1)
        short = flat if flat.shape[0] <= flat.shape[1] else flat.T
        np.testing.assert_allclose(short @ short.T / gain**2, np.eye(short.shape[0]), atol=1e-4)

    return check


def _sparse(sparsity: float, std: float) -> Callable[[np.ndarray], None]:
    def check(w: np.ndarray) -> None:
        zeros = math.ceil(sparsity * w.shape[0])
        assert ((w == 0).sum(axis=0) == zeros).all()
        assert abs(w[w != 0].std() / std - 1) < 0.1

    return check


SHAPE = (64, 32)
FAN_IN, FAN_OUT = _fans(SHAPE)
XAVIER_BOUND = 2.0 * math.sqrt(6 / (FAN_IN + FAN_OUT))
KAIMING_BOUND = math.sqrt(2 / (1 + 5)) * math.sqrt(3 / FAN_IN)  # a=sqrt(5), torch's Linear default
TN = _truncated_normal_moments(0.0, 1.0, -1.0, 2.0)
EXACT = "exact"  # equals eager torch element for element

# name: (shape, kwargs, check); the deprecated aliases (no trailing _) run with the same check
INITS: dict[str, tuple[tuple[int, ...], dict[str, Any], Any]] = {
    "uniform_": (SHAPE, {"a": -0.5, "b": 0.5}, _within(-0.5, 0.5, 0.0, 1 / math.sqrt(12))),
    "normal_": (SHAPE, {"mean": 1.0, "std": 0.5}, _spread(1.0, 0.5)),
    "trunc_normal_": (SHAPE, {"std": 1.0, "a": -1.0, "b": 2.0}, _within(-1.0, 2.0, *TN)),
    "constant_": (SHAPE, {"val": 0.3}, EXACT),
    "ones_": (SHAPE, {}, EXACT),
    "zeros_": (SHAPE, {}, EXACT),
    "eye_": ((16, 8), {}, EXACT),
    "dirac_": ((8, 4, 3), {"groups": 2}, EXACT),
    "xavier_uniform_": (SHAPE, {"gain": 2.0}, _within(-XAVIER_BOUND, XAVIER_BOUND, 0.0, XAVIER_BOUND / math.sqrt(3))),
    "xavier_normal_": (SHAPE, {}, _spread(0.0, math.sqrt(2 / (FAN_IN + FAN_OUT)))),
    "kaiming_uniform_": (
        SHAPE,
        {"a": math.sqrt(5)},
        _within(-KAIMING_BOUND, KAIMING_BOUND, 0.0, KAIMING_BOUND / math.sqrt(3)),
    ),
    "kaiming_normal_": (SHAPE, {"mode": "fan_out", "nonlinearity": "relu"}, _spread(0.0, math.sqrt(2 / FAN_OUT))),
    "orthogonal_": ((8, 4, 8), {"gain": 1.5}, _orthogonal(1.5)),  # wide: torch transposes it in place (t_)
    # a Python loop over columns, each a randperm and a scatter: XLA's compile time grows with the columns
    "sparse_": ((64, 8), {"sparsity": 0.25, "std": 0.02}, _sparse(0.25, 0.02)),
}
INITS |= {name[:-1]: INITS[name] for name in list(INITS) if name[:-1] in torch.nn.init.__all__}
INITS["orthogonal"] = ((32, 8), {}, _orthogonal(1.0))  # tall: no transpose
NOT_INITS = {"calculate_gain"}  # computes a number, fills no tensor


class EveryInit(nn.Module):
    """One parameter per public torch.nn.init function, filled by it."""

    def __init__(self):
        super().__init__()
        for name, (shape, kwargs, _) in INITS.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
            getattr(nn.init, name)(getattr(self, name), **kwargs)


@pytest.fixture(scope="module")
def every_init(mesh):
    return _built(EveryInit, mesh)


def test_every_public_init_function_is_tested():
    assert set(torch.nn.init.__all__) == set(INITS) | NOT_INITS


@pytest.mark.parametrize("name", sorted(INITS))
def test_init_function_under_init_sharded(every_init, name):
    model, sharded, eager = every_init
    assert "data" in getattr(model, name).jax().sharding.spec  # built directly sharded
    check = INITS[name][2]
    if check == EXACT:
        np.testing.assert_array_equal(sharded[name], eager[name])
    else:
        check(sharded[name])
        check(eager[name])  # the property holds for torch's own values too


# --- writes through views inside model_fn -----------------------------------------------------------------


def _read_after_write(w):
    row = w[1]  # a view made before the write sees it, as in torch
    w.fill_(2)
    row.mul_(3)


WRITES: dict[str, Callable[[torch.Tensor], Any]] = {
    "select_zero_": lambda w: w[0].zero_(),
    "column_fill_": lambda w: w[:, 1].fill_(2),
    "slice_assignment": lambda w: w.__setitem__(slice(3, 5), 7),
    "constant_into_data_slice": lambda w: nn.init.constant_(w.data[2:6], 0.5),
    "narrow": lambda w: w.narrow(0, 1, 2).fill_(3),
    "select": lambda w: w.select(1, 0).fill_(5),
    "view": lambda w: w.view(-1)[:3].fill_(7),
    "flatten": lambda w: w.flatten()[5:9].fill_(8),
    "transpose": lambda w: w.t()[0].fill_(4),
    "diagonal": lambda w: w.diagonal(1).fill_(6),
    "unbind": lambda w: w.unbind(0)[1].fill_(8),
    "chunk_mul_": lambda w: w.chunk(2, 0)[1].mul_(3),
    "copy_into_row": lambda w: w[2].copy_(torch.arange(8.0)),
    "copy_broadcasts": lambda w: w[:, 3].copy_(torch.tensor(5.0)),
    "copy_from_a_view": lambda w: w[1].copy_(w[2]),
    "index_assignment": lambda w: w.__setitem__(torch.tensor([1, 2]), 5.0),
    "mask_assignment_into_view": lambda w: w[1].__setitem__(w[1] > 10, 0.0),
    "row_of_a_row": lambda w: w[1][2:4].fill_(9),
    "normal_into_view": lambda w: w[2].normal_(mean=10.0, std=0.0),
    "clamp_into_view": lambda w: w[3].clamp_(max=28.0),
    "out_into_view": lambda w: torch.add(w[0], 1, out=w[1]),
    "eye_out": lambda w: torch.eye(8, out=w),
    "read_after_write": _read_after_write,
    # torch copies a non-contiguous tensor to reshape it: the write reaches the copy only
    "reshape_of_transpose_copies": lambda w: w.t().reshape(-1)[:3].fill_(1),
}


class ViewWrites(nn.Module):
    """One (8, 8) parameter per write, arange-valued, written under no_grad; a view kept as a buffer."""

    def __init__(self):
        super().__init__()
        for name, write in WRITES.items():
            self.register_parameter(name, nn.Parameter(torch.arange(64.0).reshape(8, 8)))
            with torch.no_grad():
                write(getattr(self, name))
        self.register_buffer("mask", torch.ones(8, 8).tril().view(1, 1, 8, 8))


@pytest.fixture(scope="module")
def view_writes(mesh):
    return _built(ViewWrites, mesh)


@pytest.mark.parametrize("name", [*WRITES, "mask"])
def test_writes_through_views_equal_eager_torch(view_writes, name):
    _, sharded, eager = view_writes
    np.testing.assert_array_equal(sharded[name], eager[name])


def _dtype_view_write():
    model = nn.Linear(8, 8)
    with torch.no_grad():
        model.weight.view(torch.int32)[0].fill_(0)  # reinterprets the bits: not written back, so an error
    return model


def _init_into_dtype_view():
    model = nn.Linear(8, 8)
    nn.init.zeros_(model.weight.view(torch.int32))
    return model


@pytest.mark.parametrize(
    ("model_fn", "match"),
    [
        (_dtype_view_write, r"writes into the result of aten\.view\.dtype, a view init_sharded cannot write back"),
        (
            _init_into_dtype_view,
            r"torch\.nn\.init\.zeros_\(\) on a tensor \(int32 \(8, 8\)\): .*aten\.view\.dtype",
        ),
    ],
    ids=["dtype_view", "init_into_dtype_view"],
)
def test_writes_init_sharded_cannot_honour_are_errors(mesh, model_fn, match):
    with pytest.raises(ShardingError, match=match):
        ts.init_sharded(model_fn, mesh, RULES)


# --- padding rows, transformers' _init_weights, torchtitan-style init_weights -------------------------------


def test_embedding_padding_row_is_zero(mesh):
    _, sharded, eager = _built(lambda: nn.Embedding(16, 8, padding_idx=3), mesh)
    assert (sharded["weight"][3] == 0).all() and (eager["weight"][3] == 0).all()
    _spread(0.0, 1.0)(np.delete(sharded["weight"], 3, axis=0))


def _check_like_eager(model_fn: Callable[[], nn.Module], mesh) -> tuple[nn.Module, dict]:
    """Tensors eager torch builds the same under two seeds equal it exactly; the others keep its spread."""
    model, sharded, eager = _built(model_fn, mesh)
    torch.manual_seed(1)
    other = _values(model_fn())
    for name, values in eager.items():
        if np.array_equal(values, other[name]):  # deterministic: norms, biases, position ids, ...
            np.testing.assert_array_equal(sharded[name], values, err_msg=name)
        elif values.size >= 512:
            assert abs(sharded[name].std() / values.std() - 1) < 0.2, (name, sharded[name].std(), values.std())
    return model, sharded


def _tiny_hf(kind: str) -> Callable[[], nn.Module]:
    tr = pytest.importorskip("transformers")
    sizes = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64}
    if kind == "llama":
        config = tr.LlamaConfig(
            **sizes, vocab_size=64, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=3
        )
        return lambda: tr.LlamaForCausalLM(config)
    if kind == "gpt2":
        config = tr.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4)
        return lambda: tr.GPT2LMHeadModel(config)
    if kind == "bert":
        config = tr.BertConfig(**sizes, vocab_size=64, max_position_embeddings=32, pad_token_id=3)
        return lambda: tr.BertModel(config)
    config = tr.ViTConfig(**sizes, image_size=8, patch_size=2, num_channels=3)
    return lambda: tr.ViTModel(config)


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64")  # position ids, held as int32
@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert", "vit"])
@pytest.mark.slow
def test_transformers_init_weights_equal_eager_torch(mesh, kind):
    model, sharded = _check_like_eager(_tiny_hf(kind), mesh)
    if kind == "llama":  # _init_weights zeroes the padding row of a normal_ embedding
        assert (sharded["model.embed_tokens.weight"][3] == 0).all()
    if kind == "bert":
        assert (sharded["embeddings.word_embeddings.weight"][3] == 0).all()
    if kind == "gpt2":  # the head stays tied to the embedding
        assert model.lm_head.weight is model.transformer.wte.weight
    if kind == "vit":  # trunc_normal_(std=initializer_range), cut at ±2
        position = sharded["embeddings.position_embeddings"]
        assert np.abs(position).max() <= 2.0 and abs(position.std() / 0.02 - 1) < 0.2


def _inverse_cdf_trunc_normal_(tensor: torch.Tensor, std: float, a: float, b: float) -> None:
    """The truncated normal as timm draws it: uniform over the CDF's range, through erfinv (in-place ops)."""
    low, high = ((1 + math.erf(x / std / math.sqrt(2))) / 2 for x in (a, b))
    with torch.no_grad():
        tensor.uniform_(2 * low - 1, 2 * high - 1).erfinv_().mul_(std * math.sqrt(2)).clamp_(min=a, max=b)


class TitanBlock(nn.Module):
    """A torchtitan-style block: modules built uninitialised, then ``init_weights`` with trunc_normal_."""

    def __init__(self, dim: int = 64, init_std: float = 0.02):
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)
        self.head = nn.Linear(dim, 2 * dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.init_weights(init_std)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.wq.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        _inverse_cdf_trunc_normal_(self.head.weight, std=0.02, a=-0.03, b=0.03)
        self.norm.reset_parameters()


def test_torchtitan_style_trunc_normal_init(mesh):
    _, sharded, eager = _built(TitanBlock, mesh)
    _within(-2.0, 2.0, 0.0, 0.02)(sharded["wq.weight"])
    _within(-0.06, 0.06, *_truncated_normal_moments(0.0, 0.02, -0.06, 0.06))(sharded["w2.weight"])
    _within(-0.03, 0.03, *_truncated_normal_moments(0.0, 0.02, -0.03, 0.03))(sharded["head.weight"])
    np.testing.assert_array_equal(sharded["norm.weight"], eager["norm.weight"])
