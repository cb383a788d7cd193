"""ts.generate on sliding-window and hybrid caches equals transformers' eager generate token for token.

The models that showed the bug (issue 42): Gemma2 and Gemma3 (sliding and full layers), Mistral and
Qwen2 with a sliding window, with Llama as the full-attention control. The window is 8 positions;
prompts of 5 tokens cross it while decoding, prompts of 20 start past it; each plain and left-padded.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torchshard as ts
from tools.families import Family, build

transformers = pytest.importorskip("transformers")

NEW = 6
WINDOW = 8
QWEN2_WINDOW = (("use_sliding_window", True), ("sliding_window", WINDOW),
                ("layer_types", ["full_attention", "sliding_attention"]))  # fmt: skip
FAMILIES = {
    "gemma2": Family("gemma2"),
    "gemma3_text": Family("gemma3_text"),
    "mistral": Family("mistral"),
    "qwen2": Family("qwen2", extra=QWEN2_WINDOW),
    "llama": Family("llama"),
}


def _model(name: str) -> torch.nn.Module:
    model = build(FAMILIES[name]).eval()
    window = getattr(model.config, "sliding_window", None)
    assert name == "llama" or window == WINDOW, f"{name}'s window is {window}"
    return model


def _prompts(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (4, seq), generator=torch.Generator().manual_seed(seq))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[3, :4] = 0
    return ids, mask


def _eager(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)


def _sharded(model: torch.nn.Module) -> torch.nn.Module:
    mesh = ts.make_mesh({"data": 4, "model": 2})
    return ts.shard(copy.deepcopy(model), ts.plan(model, mesh, ts.presets.hf_rules(model)))


def _assert_equals_eager(name: str, seq: int, *, padded_only: bool = False) -> None:
    model = _model(name)
    sharded = _sharded(model)
    ids, mask = _prompts(seq)
    for rows_mask in (mask,) if padded_only else (None, mask):
        expected = _eager(model, ids, rows_mask)
        got = ts.generate(sharded, ids, attention_mask=rows_mask, max_new_tokens=NEW, eos_token_id=[])
        assert torch.equal(got, expected), f"{name}, {seq}-token prompts, mask={rows_mask is not None}"


@pytest.mark.slow
def test_gemma2_decodes_past_its_window_as_transformers_does():
    """The quick suite's row: sliding and full layers, a left-padded prompt longer than the window."""
    _assert_equals_eager("gemma2", 20, padded_only=True)


CASES = [(name, seq) for name in FAMILIES for seq in (5, 20)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "seq"), CASES, ids=[f"{n}-prompt{s}" for n, s in CASES])
def test_greedy_equals_eager_generate_plain_and_left_padded(name, seq):
    _assert_equals_eager(name, seq)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "llama"])
def test_the_window_changes_these_models_tokens(name):
    """The comparisons above can fail: without its window, each model generates other tokens."""
    model = _model(name)
    ids, _ = _prompts(20)
    windowed = _eager(model, ids, None)
    model.config.sliding_window = 4 * ids.shape[1]
    for module in model.modules():
        if isinstance(getattr(module, "sliding_window", None), int):
            module.sliding_window = 4 * ids.shape[1]
    assert not torch.equal(_eager(model, ids, None), windowed)


REFUSED = [
    (
        "olmo_hybrid",
        r"OlmoHybridForCausalLM \(olmo_hybrid\) keeps LinearAttentionLayer state in its cache "
        r"\(layers \[0\]\)",
    ),
    ("deepseek_v32", r"DeepseekV32ForCausalLM \(deepseek_v32\) keeps StaticIndexedLayer state"),
    ("deepseek_v4", r"DeepseekV4ForCausalLM \(deepseek_v4\): transformers cannot lay out a static KV cache .*"),
    # its decode step took one token and no state: 37 of 48 greedy tokens differed from eager generate
    ("rwkv", r"RwkvForCausalLM \(rwkv\): its forward takes no past_key_values"),
]


@pytest.mark.parametrize(("model_type", "match"), REFUSED, ids=[r[0] for r in REFUSED])
def test_caches_generate_cannot_reproduce_are_refused_up_front(model_type, match, mesh_fsdp):
    model = build(Family(model_type))
    placed = ts.shard(model, ts.plan(model, mesh_fsdp))
    with pytest.raises(ts.ArgumentError, match=match + r".*refuses this model"):
        ts.generate(placed, torch.ones(2, 3, dtype=torch.int64), max_new_tokens=2)
    assert not model.__dict__.get("_torchshard_generate")  # nothing was compiled
