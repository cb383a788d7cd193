"""``ts.linear_cross_entropy`` and ``Trainer(fused_loss=)``: the LM head's loss chunked over tokens vs eager torch.

Tolerances: float32 losses and gradients within 1e-5 of eager torch's (`assert_close`: absolute,
relative to the largest value); bf16 within 2e-2 of eager torch run in bf16; AdamW losses of a
trained Llama within rtol 1e-4.
"""

from __future__ import annotations

import copy
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torchax.interop
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch.nn import functional as F

import torchshard as ts
from testsupport.helpers import assert_close, eager_value_and_grads, torch_losses
from torchshard import ArgumentError
from torchshard._bridge.env import env
from torchshard._bridge.ops import linear_cross_entropy as lowering
from torchshard._bridge.tensors import wrap

BF16_TOL = 2e-2
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


@pytest.fixture(autouse=True, scope="module")
def _torchshard_lowerings():
    env()


def _case(seed: int, lead: tuple[int, ...], width: int, vocab: int, ignored: int = -100, every: int = 0):
    """(hidden [*lead, width], weight [vocab, width], labels [*lead]) with every ``every``-th label ``ignored``."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(*lead, width, generator=gen), torch.randn(vocab, width, generator=gen) / 4
    labels = torch.randint(0, vocab, lead, generator=gen)
    if every:
        labels.view(-1)[::every] = ignored
    return hidden, weight, labels


def _plain(ignore_index: int = -100):
    def loss(hidden, weight, labels):
        logits = hidden @ weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)

    return loss


def _chunked(ignore_index: int = -100, chunk_tokens: int | None = None):
    return lambda h, w, y: ts.linear_cross_entropy(h, w, y, ignore_index=ignore_index, chunk_tokens=chunk_tokens)


# name: (inputs, ignore_index, chunk_tokens)
CASES = {
    "plain": (_case(0, (24,), 16, 40), -100, None),
    "several_chunks": (_case(1, (24,), 16, 40), -100, 6),
    "ignore_index": (_case(2, (30,), 16, 40, every=4), -100, 8),
    "own_ignore_index": (_case(3, (30,), 16, 40, ignored=7, every=3), 7, 8),
    "chunk_not_dividing_tokens": (_case(4, (37,), 16, 40, every=5), -100, 8),
    "batch_and_sequence_dims": (_case(5, (3, 10), 16, 40, every=7), -100, 4),
}


def _jax_value_and_grads(fn, inputs, place=lambda x, _: jnp.asarray(x.numpy())):
    """``fn`` on the inputs as jax arrays (placed by ``place``), jitted: (value, (dhidden, dweight), compiled HLO)."""
    arrays = [place(x, i) for i, x in enumerate(inputs)]
    grad = jax.jit(jax.value_and_grad(torchax.interop.jax_view(fn), argnums=(0, 1)))
    value, grads = grad(*arrays)
    return value, grads, grad.lower(*arrays).compile().as_text()


@pytest.mark.parametrize("name", CASES)
def test_matches_eager_torch_on_jax_and_on_plain_torch_tensors(name):
    inputs, ignore_index, chunk_tokens = CASES[name]
    expected, expected_grads = eager_value_and_grads(_plain(ignore_index), inputs, argnums=(0, 1))
    fn = _chunked(ignore_index, chunk_tokens)
    value, grads, _ = _jax_value_and_grads(fn, inputs)
    eager, eager_grads = eager_value_and_grads(fn, inputs, argnums=(0, 1))  # torch tensors: the checkpointed chunks
    for got, got_grads, where in ((value, grads, "jax"), (eager, eager_grads, "eager torch")):
        assert_close(got, expected, what=f"{name} loss ({where})")
        for what, grad, want in zip(("dhidden", "dweight"), got_grads, expected_grads, strict=True):
            assert_close(grad, want, what=f"{name} {what} ({where})")


def test_views_slicing_the_batch_inside_a_trace_are_taken():
    """``ids[:, 1:]`` of a traced batch is a torchax view, not a torchax tensor: still the jax path."""
    hidden, weight, labels = _case(9, (4, 9), 16, 40)
    expected, expected_grads = eager_value_and_grads(
        lambda h, w, y: _plain()(h[:, :-1], w, y[:, 1:]), [hidden, weight, labels], argnums=(0, 1)
    )
    fn = lambda h, w, y: ts.linear_cross_entropy(h[:, :-1], w, y[:, 1:], chunk_tokens=8)  # noqa: E731
    value, grads, _ = _jax_value_and_grads(fn, [hidden, weight, labels])
    assert_close(value, expected, what="loss")
    for what, grad, want in zip(("dhidden", "dweight"), grads, expected_grads, strict=True):
        assert_close(grad, want, what=what)


def test_bf16_inputs_match_eager_torch_in_bf16():
    inputs = [x.bfloat16() if x.is_floating_point() else x for x in _case(6, (40,), 32, 64, every=6)]
    expected, expected_grads = eager_value_and_grads(_plain(), inputs, argnums=(0, 1))

    def place(x, _):
        return jnp.asarray(x.float().numpy()).astype(jnp.bfloat16) if x.is_floating_point() else jnp.asarray(x.numpy())

    value, grads, _ = _jax_value_and_grads(_chunked(chunk_tokens=16), inputs, place)
    assert value.dtype == jnp.bfloat16 and grads[0].dtype == grads[1].dtype == jnp.bfloat16
    assert_close(value, expected.float(), tol=BF16_TOL, what="loss")
    for what, grad, want in zip(("dhidden", "dweight"), grads, expected_grads, strict=True):
        assert_close(grad.astype(jnp.float32), want.float(), tol=BF16_TOL, what=what)


# mesh axes, the weight's spec (torch's [vocab, hidden]): FSDP shards the vocabulary dim over "data", a
# column-wise tensor-parallel head over "model", and both together
LAYOUTS = {
    "fsdp": ({"data": 8}, P("data", None)),
    "tp_colwise": ({"data": 4, "model": 2}, P("model", None)),
    "fsdp_and_tp": ({"data": 4, "model": 2}, P(("model", "data"), None)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_weight_matches_eager_torch(layout):
    axes, weight_spec = LAYOUTS[layout]
    mesh = ts.make_mesh(axes)
    inputs = _case(7, (64,), 16, 96, every=5)
    expected, expected_grads = eager_value_and_grads(_plain(), inputs, argnums=(0, 1))
    specs = (P("data", None), weight_spec, P("data"))  # the tokens split over "data", as a batch is

    def place(x, i):
        return jax.device_put(jnp.asarray(x.numpy()), NamedSharding(mesh, specs[i]))

    with jax.set_mesh(mesh):
        value, grads, hlo = _jax_value_and_grads(_chunked(chunk_tokens=16), inputs, place)
    assert_close(value, expected, what=f"{layout} loss")
    for what, grad, want in zip(("dhidden", "dweight"), grads, expected_grads, strict=True):
        assert_close(grad, want, what=f"{layout} {what}")
    if layout == "tp_colwise":  # the vocabulary stays split: logits and weight are never gathered
        assert "all-gather" not in hlo


@pytest.mark.slow
def test_compiled_temp_memory_stays_under_a_third_of_the_plain_loss():
    """Llama 3's 128,256-word vocabulary × 16,384 tokens, hidden 2,048: compiled for one device, never run."""
    tokens, width, vocab = 16_384, 2_048, 128_256
    ratios = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        structs = (jax.ShapeDtypeStruct((tokens, width), dtype), jax.ShapeDtypeStruct((vocab, width), dtype),
                   jax.ShapeDtypeStruct((tokens,), jnp.int32))  # fmt: skip
        temp = {}
        for name, fn in (("plain", _plain()), ("chunked", _chunked())):
            grad = jax.jit(jax.value_and_grad(torchax.interop.jax_view(fn), argnums=(0, 1)))
            temp[name] = grad.lower(*structs).compile().memory_analysis().temp_size_in_bytes
        ratios[jnp.dtype(dtype).name] = temp["chunked"] / temp["plain"]
    assert all(r <= 0.3 for r in ratios.values()), ratios  # measured: float32 0.13, bfloat16 0.19


def _bad(hidden=None, weight=None, labels=None, **kwargs):
    h, w, y = _case(8, (4,), 8, 16)
    return lambda: ts.linear_cross_entropy(
        h if hidden is None else hidden, w if weight is None else weight, y if labels is None else labels, **kwargs
    )


BAD = {
    "hidden_width": (_bad(hidden=torch.randn(4, 6)), r"hidden \(4, 6\) must end in the weight's hidden size 8"),
    "labels_shape": (_bad(labels=torch.zeros(5, dtype=torch.long)), r"labels \(5,\) must have hidden's leading"),
    "weight_rank": (_bad(weight=torch.randn(16, 8, 1)), r"weight must be the head's \[vocab, hidden\] matrix"),
    "float_labels": (_bad(labels=torch.zeros(4)), r"labels must be class indices .* got torch.float32"),
    "bool_labels": (_bad(labels=torch.zeros(4, dtype=torch.bool)), r"class indices .* got torch.bool"),
    "integer_hidden": (_bad(hidden=torch.zeros(4, 8, dtype=torch.long)), r"must be floating, got torch.int64"),
    "dtypes_differ": (_bad(hidden=torch.randn(4, 8).bfloat16()), r"hidden is torch.bfloat16 and weight torch.float32"),
    "not_a_tensor": (_bad(hidden=np.zeros((4, 8))), r"hidden must be a torch tensor, got ndarray"),
    "chunk_zero": (_bad(chunk_tokens=0), r"chunk_tokens=0 must be an int ≥ 1"),
    "chunk_negative": (_bad(chunk_tokens=-3), r"chunk_tokens=-3 must be an int ≥ 1"),
    "chunk_float": (_bad(chunk_tokens=2.5), r"chunk_tokens=2.5 must be an int"),
    "chunk_bool": (_bad(chunk_tokens=True), r"chunk_tokens=True must be an int"),
    "ignore_index": (_bad(ignore_index="pad"), r"ignore_index='pad' must be an int"),
    "label_is_the_vocab_size": (
        _bad(labels=torch.tensor([0, 16, 3, 20])),
        r"labels hold 16 \(and 1 more out of range\), outside the vocabulary's \[0, 16\) and not ignore_index=-100",
    ),
    "label_negative": (
        _bad(labels=torch.tensor([0, -5, 3, -100])),
        r"labels hold -5, outside the vocabulary's \[0, 16\)",
    ),
    "meta_weight": (
        _bad(weight=torch.empty(16, 8, device="meta")),
        r"weight on the meta device, which holds shapes but no values",
    ),
    "places_differ": (
        lambda: ts.linear_cross_entropy(wrap(jnp.zeros((4, 8))), torch.zeros(16, 8), torch.zeros(4, dtype=torch.long)),
        r"hidden on the jax device and the rest plain torch tensors",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments_are_named(case):
    call, match = BAD[case]
    with pytest.raises(ArgumentError, match=match):
        call()


# --- transformers causal LMs under the Trainer ------------------------------------------------------------------


transformers = pytest.importorskip("transformers")
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96)  # fmt: skip


def _llama(**overrides):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**(SMALL | overrides)))


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SMALL["vocab_size"], (8, 16), generator=gen) for _ in range(n)]


def lm_labels(ids: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(ids < 8, -100)  # some padding-like labels the loss leaves out


def lm_loss(model, ids):
    return model(input_ids=ids, labels=lm_labels(ids)).loss


def _adamw_trainer(model, mesh, **kwargs):
    plan = ts.plan(model, mesh, ts.presets.hf_rules(model, fsdp_min_size=1024))
    opt = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    return ts.Trainer(model, lm_loss, opt, plan, **kwargs)


@pytest.mark.parametrize(
    ("fused", "tied"), [(True, False), (True, True), (False, False)], ids=["fused", "fused_tied", "unfused"]
)
@pytest.mark.slow
def test_llama_trains_like_eager_torch(mesh_dm, fused, tied):
    ref = _llama(tie_word_embeddings=tied)
    trainer = _adamw_trainer(copy.deepcopy(ref), mesh_dm, fused_loss=fused)
    data = _batches(3)
    got = [float(trainer.step(ids)["loss"]) for ids in data]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    np.testing.assert_allclose(got, torch_losses(ref, lm_loss, opt, data), rtol=1e-4)


@pytest.mark.slow
def test_context_parallel_llama_matches_eager_torch_and_moves_no_token(monkeypatch):
    """Under ContextParallel the flat tokens stay where the sequence split left them: no all-to-all, no gather
    (replicated weights: the plain loss moves its logits and labels with 3 all-to-alls here)."""
    monkeypatch.setattr(lowering, "LOGITS_PER_CHUNK", 1024)  # 16 chunks of 8 tokens
    ref = _llama()
    mesh = ts.make_mesh({"data": 2, "context": 4})
    model = copy.deepcopy(ref)
    opt = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    trainer = ts.Trainer(model, lm_loss, opt, ts.plan(model, mesh), batch_spec=("data", "context"),
                         context=ts.ContextParallel())  # fmt: skip
    data = _batches(2)
    got = [float(trainer.step(ids)["loss"]) for ids in data]
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    np.testing.assert_allclose(got, torch_losses(ref, lm_loss, torch_opt, data), rtol=1e-4)
    stats = ts.inspect.collectives(trainer, data[0])
    assert stats.count("all-to-all") == stats.count("all-gather") == 0, stats


def _full_logits(hlo: str, vocab: int) -> list[str]:
    """The float arrays of the compiled step holding every token's logits, ``[8, 16, vocab]`` or ``[128, vocab]``."""
    return re.findall(rf"f32\[(?:8,16|128),{vocab}\]", hlo)


@pytest.mark.slow
def test_the_fused_path_is_taken_and_the_whole_logits_vanish(monkeypatch, caplog):
    monkeypatch.setattr(lowering, "LOGITS_PER_CHUNK", 1024)  # ≤ 10 tokens a chunk (16 chunks of 8): a loop
    one = ts.make_mesh({"data": 1}, devices=jax.devices()[:1])
    hlo = {}
    for fused in (True, False):
        model = _llama()
        trainer = ts.Trainer(model, lm_loss, optax.sgd(0.1), ts.plan(model, one), fused_loss=fused)
        with caplog.at_level(logging.DEBUG, logger="torchshard"):
            hlo[fused] = trainer.lower(_batches(1)[0]).compile().as_text()
    assert "LlamaForCausalLM: loss fused with its LM head" in caplog.text
    assert _full_logits(hlo[False], 96) and not _full_logits(hlo[True], 96)
    assert re.search(r"f32\[8,96\]", hlo[True]) and " while(" in hlo[True]


def test_eager_loss_and_grads_inside_the_hook_match_transformers_loss(caplog):
    """The hook on a CPU model (eager torch): every argument of transformers' causal-LM loss it honours."""
    from torchshard._strategies.fused_loss.head_loss import fused_head_losses

    ids = _batches(1)[0]
    shifted = torch.cat([ids[:, 1:], torch.full((8, 1), -100)], 1).masked_fill(ids < 20, -100)
    calls = {
        "labels": {"labels": ids},
        "ignore_index": {"labels": ids.masked_fill(ids < 30, 5), "ignore_index": 5},
        "num_items_in_batch": {"labels": lm_labels(ids), "num_items_in_batch": torch.tensor(77)},
        "shift_labels": {"labels": ids, "shift_labels": shifted},
    }
    for name, kwargs in calls.items():
        model = _llama()
        expected = model(input_ids=ids, **kwargs).loss
        expected.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="torchshard"), fused_head_losses(model):
            got = model(input_ids=ids, **kwargs).loss
        assert "loss fused" in caplog.text, name
        got.backward()
        assert_close(got, expected.detach(), what=f"{name} loss")
        for n, p in model.named_parameters():
            assert_close(p.grad, want[n], what=f"{name} grad of {n}")
        assert "_loss_function" not in vars(model) and not model.lm_head._forward_hooks  # all put back


@pytest.mark.slow
def test_soft_capped_logits_fall_back_to_the_models_own_loss(caplog):
    """Gemma 2 soft-caps its logits before the loss: the loss gets a new tensor, so the model's own loss runs."""
    config = transformers.Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=5.0, sliding_window=8)
    torch.manual_seed(0)
    ref = transformers.Gemma2ForCausalLM(config)
    model = copy.deepcopy(ref)
    one = ts.make_mesh({"data": 1}, devices=jax.devices()[:1])
    trainer = ts.Trainer(model, lm_loss, optax.sgd(0.1), ts.plan(model, one))
    data = _batches(2)
    with caplog.at_level(logging.DEBUG, logger="torchshard"):
        got = [float(trainer.step(ids)["loss"]) for ids in data]
    assert "Gemma2ForCausalLM: its loss got logits other than its LM head's output" in caplog.text
    np.testing.assert_allclose(got, torch_losses(ref, lm_loss, torch.optim.SGD(ref.parameters(), lr=0.1), data),
                               rtol=1e-4)  # fmt: skip
    assert _full_logits(trainer.lower(data[0]).compile().as_text(), 96)


BAD_FUSED_LOSS = [
    ("yes", r"fused_loss must be True, False or 'tokamax', got 'yes'"),
    (1, r"fused_loss must be True, False or 'tokamax', got 1"),
    (0.0, r"fused_loss must be True, False or 'tokamax', got 0.0"),
    ("Tokamax", r"fused_loss must be True, False or 'tokamax', got 'Tokamax'"),
    (np.array([1, 2]), r"fused_loss must be True, False or 'tokamax', got array"),
    ("missing tokamax", r"fused_loss='tokamax' cannot run here: tokamax cannot be imported .*: pip install tokamax"),
]


@pytest.mark.parametrize(("value", "match"), BAD_FUSED_LOSS, ids=[repr(v)[:20] for v, _ in BAD_FUSED_LOSS])
def test_bad_fused_loss_is_an_argument_error(mesh_fsdp, monkeypatch, value, match):
    from torchshard._bridge.ops import tokamax_attention

    if isinstance(value, str) and value == "missing tokamax":  # where it cannot be imported (the pinned lane), by name
        monkeypatch.setattr(
            tokamax_attention, "missing", lambda: "tokamax cannot be imported (...): pip install tokamax"
        )
        value = "tokamax"
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ArgumentError, match=match):
        ts.Trainer(model, lambda m, b: m(b).sum(), optax.sgd(0.1), ts.plan(model, mesh_fsdp), fused_loss=value)
