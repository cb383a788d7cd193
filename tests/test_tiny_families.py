"""Every family's tiny config keeps the relations of its real (default) config (`tools.tiny.RELATIONS`)."""

from __future__ import annotations

import warnings

import pytest
from packaging.version import Version

from tools.families import config, family
from tools.tiny import broken_relations, kv_heads, read, tiny_kwargs

transformers = pytest.importorskip("transformers")

# families whose tiny config cannot keep a relation, and why (each is a row the matrix skips or marks)
CANNOT = {
    "gemma4_assistant": "its default config does not validate",
    "prophetnet": "it has no num_hidden_layers to shrink (encoder and decoder layers instead)",
    "xlnet": "its config refuses a max_position_embeddings",
}
if Version(transformers.__version__) < Version("5.20"):
    CANNOT |= dict.fromkeys(("musicgen", "musicgen_melody"), "transformers < 5.20 cannot build its default config")
# the floor lane's transformers 5.17 has no such family
NEEDS_DOTS3 = pytest.mark.skipif(not hasattr(transformers, "Dots3NoteTextConfig"), reason="Dots3-Note is new in 5.23")

# relations a family's own overrides change on purpose
CHANGED = {
    ("granitemoehybrid", "layer kinds"): "its default config has Mamba layers only; the family adds an attention "
    "layer, as Granite-4's checkpoints mix them",
    ("hunyuan_v1_moe", "top-k over several experts"): "its default config is one expert, top-1 (a dense MLP); the "
    "family routes top-2 of 8, as Hunyuan-A13B routes 8 of 64",
}


def _types() -> list[str]:
    from tools.families import causal_lm_types

    return causal_lm_types()


def _default(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return getattr(transformers, CONFIG_MAPPING_NAMES[model_type])()


@pytest.mark.parametrize("model_type", _types())
def test_the_tiny_config_keeps_the_real_configs_relations(model_type):
    if model_type in CANNOT:
        pytest.skip(CANNOT[model_type])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on rope scaling and token ids of the tiny sizes
        default, tiny = _default(model_type), config(family(model_type))
        deep = config(family(model_type), layers=4)  # the circular pipeline's depth: per-layer overrides follow it
    if depth := read(tiny, "num_hidden_layers"):  # nested configs (skipped rows) have none; HRM's counts its cycles
        assert read(deep, "num_hidden_layers") == 2 * depth
    changed = {relation for (t, relation) in CHANGED if t == model_type}
    assert [b for b in broken_relations(default, tiny) if b.split(":")[0] not in changed] == []


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        # DeepSeek-V3: queries and keys 128 + 64 wide, values 128; 128 heads, MLA (as many KV heads)
        ("deepseek_v3", {"qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4}),
        # Gemma-7B: 16 heads of 256 for a hidden size of 3072 (3/4 of 16 × 256); tied embeddings
        ("gemma", {"num_attention_heads": 4, "head_dim": 16, "hidden_size": 48, "tie_word_embeddings": True}),
        # Mistral-7B: 32 query heads over 8 KV heads, a sliding window
        ("mistral", {"num_attention_heads": 8, "num_key_value_heads": 2, "sliding_window": 8}),
        # GPT-J: rotary on 64 of each head's 256 dims
        ("gptj", {"rotary_dim": 4, "n_embd": 64}),
        # Falcon-7B: multi-query attention (one KV head for 71 query heads)
        ("falcon", {"num_attention_heads": 4, "multi_query": True}),
        # Falcon-H1: an SSM inner width of 1024 (1/4 of hidden 4096) in heads of 8, states of 256, chunks of 256
        (
            "falcon_h1",
            {
                "hidden_size": 128,
                "mamba_d_ssm": 32,
                "mamba_n_heads": 4,
                "mamba_d_head": 8,
                "mamba_d_state": 16,
                "mamba_chunk_size": 8,
            },
        ),
        # Bamba: 128 SSM heads of 64 covering hidden × expand 2
        ("bamba", {"hidden_size": 128, "mamba_n_heads": 16, "mamba_d_head": 16, "mamba_expand": 2}),
        # Qwen3-Next: gated delta rule with 32 value heads over 16 key heads (of 128, beside attention's 256)
        (
            "qwen3_next",
            {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8, "head_dim": 8},
        ),
        # Inkling: sliding-window layers with their own 64 query heads over 16 KV heads
        ("inkling_text", {"swa_num_attention_heads": 8, "swa_num_key_value_heads": 2, "swa_head_dim": 8}),
        # Dots3-Note: its sliding layers' MLA queries are 192 + 64 wide where its indexed layers' are 128 + 64
        pytest.param("dots3_note_text", {"qk_nope_head_dim": 16, "qk_rope_head_dim": 8}, marks=NEEDS_DOTS3),
    ],
)
def test_known_relations_come_out_as_expected(model_type, expected):
    tiny = config(family(model_type))
    assert {k: read(tiny, k) for k in expected} == expected


@NEEDS_DOTS3
def test_a_config_whose_layers_differ_keeps_each_kinds_own_sizes():
    tiny = config(family("dots3_note_text"))
    indexed, sliding = tiny.per_layer_config[0], tiny.per_layer_config[1]
    assert tiny.layer_types == ["indexed_attention", "sliding_attention"]
    assert (indexed.qk_nope_head_dim, sliding.qk_nope_head_dim, sliding.head_dim) == (16, 24, 32)  # 24 + 8 rotary


def test_a_broken_relation_is_named_with_both_values():
    default = transformers.DeepseekV3Config()
    flattened = transformers.DeepseekV3Config(**(tiny_kwargs(default) | {"v_head_dim": 24}))
    assert broken_relations(default, flattened) == ["value head dim vs query head dim: default <, tiny ="]
    assert kv_heads(transformers.FalconConfig()) == 1


def _overridden() -> list:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from tools.families import DENSE, MOE, OTHER

    newer = pytest.mark.skip(reason=f"a family newer than the installed transformers {transformers.__version__}")
    types = [f.model_type for f in DENSE + MOE + OTHER if f.extra]
    return [pytest.param(t, marks=() if t in CONFIG_MAPPING_NAMES else newer) for t in types]


@pytest.mark.parametrize("model_type", _overridden())
def test_a_familys_overrides_reach_its_config(model_type):
    """An override is not undone by tiny's value of one of its aliases (hunyuan_v1_moe's ``num_experts=8``
    came out 1: tiny also set ``num_local_experts``, which the config maps onto it and sets after)."""
    fam = family(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = config(fam)
    for name, value in fam.extra:
        if not isinstance(value, list | tuple | dict):  # per-layer lists are repeated, nested configs rebuilt
            assert read(built, name) == value, (name, read(built, name), value)
