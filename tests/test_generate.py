"""ts.generate: compiled decoding equals transformers' eager generate and a plain torch loop, token for token."""

from __future__ import annotations

import copy

import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P
from packaging.version import Version

import torchshard as ts
from testsupport.generation import NEW, eager_generate, left_padded, prompts
from testsupport.models import TiedLM
from torchshard._generate.decode_cache import cache_keyword
from torchshard._generate.generate import kv_sharding

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _sharded(model: torch.nn.Module, axes: dict[str, int], preset: str) -> torch.nn.Module:
    mesh = ts.make_mesh(axes)
    presets = {
        "hf": lambda: ts.presets.hf_rules(model),
        "hf-no-tp": lambda: ts.presets.hf_rules(model, axis=None),  # GPT-2 ships no tensor-parallel plan
        "fsdp": lambda: ts.presets.fsdp(min_size=64),
    }
    rules = presets[preset]()
    return ts.shard(model, ts.plan(model, mesh, rules))


CASES = [
    ("llama", _llama, {"data": 4, "model": 2}, "hf"),
    ("llama", _llama, {"data": 8}, "fsdp"),
    ("gpt2", _gpt2, {"data": 4, "model": 2}, "hf-no-tp"),
    ("gpt2", _gpt2, {"data": 8}, "fsdp"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "build", "axes", "preset"), CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_greedy_equals_eager_transformers_generate_with_left_padding(name, build, axes, preset):
    model = build()
    ids = prompts()
    mask = left_padded(ids)
    expected = eager_generate(model, ids, attention_mask=mask, eos_token_id=None)
    expected_unpadded = eager_generate(model, ids, eos_token_id=None)
    sharded = _sharded(copy.deepcopy(model), axes, preset)
    got = ts.generate(sharded, ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=[])
    assert torch.equal(got, expected)
    assert torch.equal(ts.generate(sharded, ids, max_new_tokens=NEW, eos_token_id=[]), expected_unpadded)


@pytest.mark.slow
def test_rows_stop_at_eos_and_are_padded_as_transformers_does():
    model = _llama()
    ids = prompts()
    free = eager_generate(model, ids, eos_token_id=None)
    eos = int(free[2, ids.shape[1] + 1])  # row 2 makes it second, so it stops there
    expected = eager_generate(model, ids, eos_token_id=eos, pad_token_id=7)
    sharded = _sharded(copy.deepcopy(model), {"data": 4, "model": 2}, "hf")
    for loop in ("fused", "stepped"):
        got = ts.generate(sharded, ids, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=7, loop=loop)
        assert torch.equal(got, expected), loop
    assert (got[2, ids.shape[1] + 2 :] == 7).all()


@pytest.mark.slow
def test_every_row_stopping_ends_generation_early_as_transformers_does():
    model = _llama()
    ids = prompts(rows=1)
    first = int(eager_generate(model, ids, eos_token_id=None)[0, ids.shape[1]])
    got = ts.generate(_sharded(model, {"data": 8}, "fsdp"), ids, max_new_tokens=NEW, eos_token_id=first)
    assert got.shape == (1, ids.shape[1] + 1)
    assert int(got[0, -1]) == first


@pytest.mark.slow
def test_generating_from_a_trainer_reads_its_latest_weights():
    model = _llama().train()
    mesh = ts.make_mesh({"data": 4, "model": 2})
    plan = ts.plan(model, mesh, ts.presets.hf_rules(model))
    trainer = ts.Trainer(model, lambda m, b: m(input_ids=b, labels=b).loss, optax.sgd(0.5), plan)
    ids = prompts()
    trainer.step(prompts(seed=2, seq=8))
    trained = _llama()
    trained.load_state_dict(ts.to_torch_state_dict(trainer.model))
    expected = eager_generate(trained, ids, eos_token_id=None)
    assert torch.equal(ts.generate(trainer, ids, max_new_tokens=NEW, eos_token_id=[]), expected)
    assert trainer.step_count == 1  # generating changed nothing
    assert trainer.model.training  # and left the mode it found


@pytest.mark.slow
def test_sampling_is_reproducible_from_its_seed_and_the_same_in_both_loops():
    sharded = _sharded(_llama(), {"data": 4, "model": 2}, "hf")
    ids = prompts()
    sample = lambda **kw: ts.generate(sharded, ids, max_new_tokens=NEW, eos_token_id=[], temperature=1.5, **kw)  # noqa: E731
    first = sample(seed=3, top_k=50, top_p=0.95)
    assert torch.equal(sample(seed=3, top_k=50, top_p=0.95), first)
    assert torch.equal(sample(seed=3, top_k=50, top_p=0.95, loop="stepped"), first)
    assert not torch.equal(sample(seed=4, top_k=50, top_p=0.95), first)
    greedy = ts.generate(sharded, ids, max_new_tokens=NEW, eos_token_id=[])
    assert torch.equal(sample(seed=3, top_k=1), greedy)  # one candidate left: sampling is greedy
    assert torch.equal(sample(seed=3, top_p=1e-6), greedy)


def _eager_window(model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_any_causal_lm_decodes_over_a_fixed_window_like_a_plain_torch_loop():
    torch.manual_seed(0)
    model = TiedLM(vocab=64, dim=32, seq=8)  # 8 positions: prompt 3 + 5 new
    ids = torch.randint(0, 64, (4, 3), generator=torch.Generator().manual_seed(0))
    expected = _eager_window(model, ids, 5)
    sharded = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.fsdp(min_size=64)))
    assert torch.equal(ts.generate(sharded, ids, max_new_tokens=5), expected)
    assert torch.equal(ts.generate(sharded, ids, max_new_tokens=5, loop="stepped"), expected)
    assert len(sharded._torchshard_generate) == 1  # both loops of one shape: one compiled program


def test_kv_cache_is_sharded_like_the_key_projection_heads(mesh_dm, mesh_fsdp):
    model = _llama()
    hf = ts.shard(copy.deepcopy(model), ts.plan(model, mesh_dm, ts.presets.hf_rules(model)))
    assert kv_sharding(hf, mesh_dm, rows=8).spec == P(("data",), "model", None, None)
    assert kv_sharding(hf, mesh_dm, rows=3).spec == P(None, "model", None, None)  # 3 rows do not split 4 ways
    fsdp = ts.shard(model, ts.plan(model, mesh_fsdp, ts.presets.fsdp(min_size=64)))
    assert kv_sharding(fsdp, mesh_fsdp, rows=8).spec == P(("data",), None, None, None)


@pytest.fixture(scope="module")
def placed():
    model = TiedLM(vocab=64, dim=32, seq=8)
    return ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))


IDS = torch.zeros(2, 3, dtype=torch.int64)
BAD = [
    ({"max_new_tokens": 0}, r"max_new_tokens=0: generate at least one token"),
    ({"max_new_tokens": -2}, r"max_new_tokens=-2"),
    ({"max_new_tokens": True}, r"max_new_tokens=True"),
    ({"max_new_tokens": 2, "temperature": -1.0}, r"temperature=-1.0"),
    ({"max_new_tokens": 2, "top_k": 0}, r"top_k=0"),
    ({"max_new_tokens": 2, "top_p": 1.5}, r"top_p=1.5"),
    ({"max_new_tokens": 2, "eos_token_id": "2"}, r"eos_token_id='2'"),
    ({"max_new_tokens": 2, "seed": 1.0}, r"seed=1.0"),
    ({"max_new_tokens": 2, "loop": "eager"}, r"loop='eager'"),
    ({"max_new_tokens": 2, "input_ids": IDS.float()}, r"input_ids is Tensor \[2, 3\]: pass integer token ids"),
    ({"max_new_tokens": 2, "input_ids": IDS[0]}, r"input_ids is Tensor \[3\]"),
    ({"max_new_tokens": 2, "input_ids": [[1, 2]]}, r"input_ids is list"),
    ({"max_new_tokens": 2, "input_ids": IDS[:, :0]}, r"input_ids has shape \[2, 0\]"),
    ({"max_new_tokens": 2, "attention_mask": torch.ones(2, 4)}, r"attention_mask \[2, 4\] must be a tensor shaped"),
    ({"max_new_tokens": 2, "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}, r"rows \[0\] are not left-pad"),
    ({"max_new_tokens": 2, "attention_mask": torch.full((2, 3), 2)}, r"values other than 0 and 1"),
    # eager nn.Embedding raises for ids outside its rows: so does generate, naming them and the vocabulary
    (
        {"max_new_tokens": 2, "input_ids": torch.tensor([[1, 64, 3], [-1, 0, 64]])},
        r"input_ids holds 3 id\(s\) outside the vocabulary \[0, 64\): \[-1, 64\] \(first at row 0, position 1\); "
        r"the input embedding Embedding has 64 rows",
    ),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD, ids=[m for _, m in BAD])
def test_bad_arguments_raise_an_argument_error_naming_them(placed, kwargs, match):
    kwargs = {"input_ids": IDS, **kwargs}
    with pytest.raises(ts.ArgumentError, match=match):
        ts.generate(placed, kwargs.pop("input_ids"), **kwargs)


def test_every_bad_argument_is_named_at_once(placed):
    with pytest.raises(ts.ArgumentError, match=r"3 bad argument\(s\)(.|\n)*max_new_tokens(.|\n)*top_k(.|\n)*seed"):
        ts.generate(placed, IDS, max_new_tokens=0, top_k=-1, seed="x")


def test_a_prompt_past_the_models_positions_is_refused():
    model = _sharded(_llama(), {"data": 8}, "fsdp")  # 32 positions
    with pytest.raises(ts.ArgumentError, match=r"30 tokens\) and max_new_tokens=3 need 33 positions; .* hold 32"):
        ts.generate(model, torch.zeros(1, 30, dtype=torch.int64), max_new_tokens=3)


def test_targets_that_cannot_generate_are_named(placed):
    unplaced = r"11 tensor\(s\) are not on the mesh \(pos, embed.weight.*ts.shard\(model, plan\)"
    with pytest.raises(ts.ArgumentError, match=unplaced):
        ts.generate(TiedLM(), IDS, max_new_tokens=2)
    with pytest.raises(ts.ArgumentError, match=r"target is a str; pass a ts.Trainer"):
        ts.generate("gpt2", IDS, max_new_tokens=2)
    with pytest.raises(ts.ArgumentError, match=r"TiedLM is not a transformers causal LM.*ids alone"):
        ts.generate(placed, IDS, max_new_tokens=2, attention_mask=torch.ones_like(IDS))


def test_a_model_that_does_not_return_logits_is_named():
    model = torch.nn.Embedding(16, 4)  # [B, T] → [B, T, 4] embeddings: fine; a 2-D output is not logits
    model = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
    with pytest.raises(ts.ArgumentError, match=r"could not decode with Sequential: it is not a causal LM .*logits \["):
        ts.generate(torch.nn.Sequential(model, torch.nn.Flatten()), IDS, max_new_tokens=2)


def _placed(model: torch.nn.Module) -> torch.nn.Module:
    return ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))


def test_a_model_that_is_not_a_causal_lm_is_named_not_its_batch():
    """A float model once blamed the batch's dtype; a transformers model that is not a causal LM
    (a base model, a classifier, a masked LM that would silently see the padding) is refused up front."""
    mlp = _placed(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    accepts = r"generate takes a transformers causal LM \(an AutoModelForCausalLM class\) or a module mapping"
    with pytest.raises(ts.ArgumentError, match=r"decode with Sequential: it is not a causal LM .*" + accepts):
        ts.generate(mlp, IDS, max_new_tokens=2)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    for model in (transformers.LlamaModel(transformers.LlamaConfig(**sizes, vocab_size=64)),
                  transformers.BertForMaskedLM(transformers.BertConfig(**sizes, vocab_size=64))):  # fmt: skip
        name = type(model).__name__
        with pytest.raises(ts.ArgumentError, match=rf"{name} is not a causal LM \(a transformers .*" + accepts):
            ts.generate(_placed(model), IDS, max_new_tokens=2)
        assert not model.__dict__.get("_torchshard_generate")  # refused before anything was compiled


def test_the_cache_goes_in_under_the_name_the_models_forward_takes():
    """transformers 5.24 renamed forward's past_key_values to cache (and warns for the old name)."""

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return input_ids

    renamed = Version(transformers.__version__) >= Version("5.24")
    assert cache_keyword(_llama()) == ("cache" if renamed else "past_key_values")
    assert cache_keyword(Renamed()) == "cache"


def test_a_trainer_with_stacked_layers_is_refused_with_the_option_named():
    from testsupport.models import BlockStack

    model = BlockStack()
    plan = ts.plan(model, ts.make_mesh({"data": 8}))
    trainer = ts.Trainer(model, lambda m, x: m(x).mean(), optax.sgd(0.1), plan, scan_layers=True)
    with pytest.raises(ts.ArgumentError, match=r"scan_layers= or pipeline="):
        ts.generate(trainer, IDS, max_new_tokens=2)


@pytest.mark.slow
def test_a_left_padded_batch_trains_like_torch_padding_positions_included():
    """The left-padding difference from torch (1.0e-3 in this loss): padded queries see no key, torch gives zeros."""
    model = _llama()
    ids = prompts(seq=12)
    mask = torch.ones_like(ids)
    mask[::2, :5] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, labels=ids).loss.item()
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.hf_rules(model))
    loss_fn = lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[0]).loss  # noqa: E731
    got = float(ts.Trainer(model, loss_fn, optax.sgd(0.0), plan).step((ids, mask))["loss"])
    assert got == pytest.approx(expected, rel=1e-5)
