"""Tiny configs that keep each family's structure: sizes shrink, the relations between a config's fields stay.

A family's tiny config is derived from its own default config (the real model's), so what makes a
model hard to shard survives the shrinking: the query/key vs value head dims of multi-head latent
attention (DeepSeek-V3's 192 vs 128), a ``head_dim`` other than hidden/heads (Gemma's 256 × 16 heads
for 3072), the grouped-query ratio (Llama-3's 4 query heads per KV head, MQA's one KV head), partial
rotary dims, sliding windows shorter than the sequence, shared experts and top-k routing, tied
embeddings. `RELATIONS` names each relation and checks it between a default and a tiny config;
tests/test_tiny_families.py checks every family with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

# fixed everywhere: small vocabulary and positions, two layers, no dropout noise, windows of 8 (sequences of 16+)
FIXED: dict[str, Any] = {
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "num_hidden_layers": 2,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "router_jitter_noise": 0.0,
    "router_aux_loss_coef": 0.0,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
    # the sparse-attention indexer keeps every key: its top-k is a discontinuous choice, and float noise
    # of a different (sharded) summation order flips near-ties (deepseek_v32 at top-8 of 16: losses 1.2e-4
    # apart by step 4, though equal to 1e-7 when nothing is dropped), which says nothing about torchshard
    "index_topk": 128,
    "decoder_sparse_step": 1,
}
SEQ = 16  # the shortest sequence the matrix trains on: every window must be shorter
HEAD_DIM = 16  # a tiny head (8 where a family's query/KV ratio needs many heads)
MLA_ROPE = 8  # multi-head latent attention's rotary dim, tiny; its other dims keep their ratios to it
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k")
SHARED_FIELDS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# feed-forward widths: every int field so named (intermediate_size, moe_/shared_/dense_..., ffn_dim, decoder_ffn_dim)
WIDTH = re.compile(r"(^|_)(intermediate_size|ffn_dim)$")
# state-space heads: (heads, head dim, expand, inner width or None, groups), as each family names them
SSM_HEADS = (
    ("num_heads", "head_dim", "expand", None, "n_groups"),  # Mamba-2
    ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_d_ssm", "mamba_n_groups"),  # Bamba, Falcon-H1, Granite
    ("mamba_num_heads", "mamba_head_dim", "expand", None, "n_groups"),  # Nemotron-H
    ("n_mamba_heads", "mamba_headdim", "mamba_expand", None, "mamba_ngroups"),  # Zamba2
)
SSM_STATE = ("state_size", "mamba_d_state", "ssm_state_size")
SSM_CHUNK = ("chunk_size", "mamba_chunk_size")
# (query or value heads, key heads, key head dim, value head dim) of attention kept apart from the main heads
SIDE_HEADS = (
    ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"),
    ("swa_num_key_value_heads", "swa_num_attention_heads", "swa_head_dim", None),
)
_DROPOUT = re.compile(r"dropout|layerdrop|drop_prob|_pdrop")
# fields set even where the default is None (the config then reads them)
EVEN_IF_NONE = ("head_dim", "pad_token_id", "num_experts_per_tok")


def read(config: Any, name: str) -> Any:
    """``config.name``, or None where it is missing; the first layer's where it varies per layer (a global read is
    transformers' AmbiguousGlobalPerLayerAttributeError: Dots3-Note's heads)."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' per-layer attribute error has no public base class
        layers = config.per_layer_config
        return getattr(layers[0], name, None) if len(layers) else None


def first(config: Any, names: tuple[str, ...]) -> Any:
    """The first of ``names`` the config has set (not None), else None."""
    return next((v for n in names if (v := read(config, n)) is not None), None)


def kv_heads(config: Any) -> int | None:
    """The KV heads of a config: its own field, one for multi-query attention, else as many as query heads."""
    if read(config, "multi_query") is True and not read(config, "new_decoder_architecture"):
        return 1  # Falcon and GPTBigCode: one KV head, whatever num_kv_heads says
    kv = first(config, ("num_key_value_heads", "num_kv_heads", "n_head_kv"))
    heads = read(config, "num_attention_heads")
    return kv if isinstance(kv, int) else heads if isinstance(heads, int) else None


def head_dim(config: Any) -> int | None:
    """The per-head width: ``head_dim`` where set, else hidden / heads."""
    dim, hidden, heads = read(config, "head_dim"), read(config, "hidden_size"), read(config, "num_attention_heads")
    if isinstance(dim, int):
        return dim
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _even(x: float, *, least: int = 2) -> int:
    return max(least, 2 * round(x / 2))


def _multiple(x: float, of: int) -> int:
    return max(of, of * round(x / of))


def _heads(heads: int, kv: int) -> tuple[int, int]:
    """Tiny (query heads, KV heads) with the same ratio: MHA 4:4, MQA 4:1, else 2 KV heads."""
    if kv == heads:
        return 4, 4
    if kv == 1 or heads % kv:
        return 4, 1 if kv == 1 else 2
    return 2 * (heads // kv), 2  # two KV heads, so a tensor-parallel axis of 2 splits them


def _attention(default: Any, kw: dict[str, Any]) -> None:
    """Heads, head dims and the hidden size, keeping GQA, head_dim vs hidden/heads, values vs queries, rotary."""
    heads, kv, hidden, dim = (
        read(default, "num_attention_heads"),
        kv_heads(default),
        read(default, "hidden_size"),
        head_dim(default),
    )
    known = all(isinstance(x, int) and x > 0 for x in (heads, kv, hidden, dim))
    tiny_heads, tiny_kv = _heads(heads, kv) if known else (4, 2)  # per-layer heads: the former fixed sizes
    kw.update(num_attention_heads=tiny_heads, num_key_value_heads=tiny_kv)
    rope = read(default, "qk_rope_head_dim")
    if isinstance(rope, int) and rope > 0:  # MLA: the hidden size is free of the heads; dims scale with the rope's
        scale = rope / MLA_ROPE
        kw.update(hidden_size=64, qk_rope_head_dim=MLA_ROPE)
        for name in ("qk_nope_head_dim", "v_head_dim"):
            if isinstance(value := read(default, name), int):
                kw[name] = _even(value / scale)
        kw["head_dim"] = MLA_ROPE if not isinstance(dim, int) or dim == rope else _even(dim / scale)
        return
    if not known:
        kw.update(hidden_size=64, head_dim=HEAD_DIM)
        return
    tiny_dim = HEAD_DIM if tiny_heads <= 8 else 8
    kw["head_dim"] = tiny_dim
    if isinstance(value := read(default, "v_head_dim"), int):  # values narrower than queries without MLA
        kw["v_head_dim"] = _even(value * tiny_dim / dim)
        if value != dim and kw["v_head_dim"] == tiny_dim:
            kw["v_head_dim"] = tiny_dim // 2 if value < dim else tiny_dim * 2
    if isinstance(rotary := read(default, "rotary_dim"), int):
        kw["rotary_dim"] = _even(rotary * tiny_dim / dim)
    width = tiny_heads * tiny_dim
    if dim * heads == hidden:
        kw["hidden_size"] = width
        return
    tiny_hidden = _multiple(hidden * width / (heads * dim), 8)
    kw["hidden_size"] = tiny_hidden if tiny_hidden != width else width + 8


def _ssm(default: Any, kw: dict[str, Any]) -> None:
    """State-space heads that cover their inner width (hidden × expand, or Falcon-H1's d_ssm in its real ratio to
    the hidden size) with heads of at most `HEAD_DIM`; states of 16 and chunks shorter than the sequence."""
    hidden = read(default, "hidden_size")
    for heads_field, dim_field, expand_field, inner_field, groups_field in SSM_HEADS:
        heads, dim, expand = (read(default, n) for n in (heads_field, dim_field, expand_field))
        inner = read(default, inner_field) if inner_field else None
        inner = inner if isinstance(inner, int) else expand * hidden if isinstance(expand, int) else None
        if not all(isinstance(x, int) and x > 0 for x in (heads, dim, hidden, inner)) or heads * dim != inner:
            continue
        tiny_dim = min(dim, HEAD_DIM)
        tiny_inner = _multiple(inner * kw["hidden_size"] / hidden, tiny_dim)
        kw.update({heads_field: tiny_inner // tiny_dim, dim_field: tiny_dim})
        if inner_field and isinstance(read(default, inner_field), int):
            kw[inner_field] = tiny_inner
        if isinstance(groups := read(default, groups_field), int):
            kw[groups_field] = math.gcd(groups, tiny_inner // tiny_dim)
    for name in SSM_STATE:
        if isinstance(value := read(default, name), int) and value > 16:
            kw[name] = 16
    for name in SSM_CHUNK:
        if isinstance(value := read(default, name), int) and value >= SEQ:
            kw[name] = SEQ // 2  # two chunks of the shortest sequence: the chunked scan, not one block


def _linear_attention(default: Any, kw: dict[str, Any]) -> None:
    """Linear-attention heads (Qwen3-Next's gated delta rule) and sliding-window heads kept apart from the main
    ones (Inkling's), each with their own ratios: key vs value heads and dims, against the main head dim."""
    for key_heads, value_heads, key_dim, value_dim in SIDE_HEADS:
        kh, vh, kd = read(default, key_heads), read(default, value_heads), read(default, key_dim)
        if not all(isinstance(x, int) and x > 0 for x in (kh, vh, kd)):
            continue
        tiny_v, tiny_k = _heads(vh, kh)
        main = head_dim(default)
        tiny_kd = _even(kd * kw["head_dim"] / main, least=8) if main and "head_dim" in kw else min(kd, HEAD_DIM)
        kw.update({key_heads: tiny_k, value_heads: tiny_v, key_dim: tiny_kd})
        if value_dim and isinstance(vd := read(default, value_dim), int):
            kw[value_dim] = _even(vd * tiny_kd / kd)


def widths(config: Any) -> dict[str, int]:
    """The config's feed-forward widths (`WIDTH`), by field name.

    Examples:
        >>> import transformers
        >>> widths(transformers.OPTConfig())
        {'ffn_dim': 3072}
    """
    fields = (k for k in vars(config) if not k.startswith("_") and WIDTH.search(k))
    return {k: v for k in fields if isinstance(v := read(config, k), int) and not isinstance(v, bool)}


def _widths(default: Any, kw: dict[str, Any]) -> None:
    """Feed-forward widths in the same ratio to the hidden size as the real model's (at least 16)."""
    hidden = read(default, "hidden_size")
    for name, value in widths(default).items():
        if value > 0 and isinstance(hidden, int) and hidden > 0:
            kw[name] = _multiple(value * kw["hidden_size"] / hidden, 16)


def _experts(default: Any, kw: dict[str, Any]) -> None:
    """Fewer experts (8, or 4 under 8), top-1 kept top-1 and top-k≥2 made top-2, shared experts and groups kept."""
    experts = first(default, EXPERT_FIELDS)
    if not isinstance(experts, int) or experts < 1:
        return
    tiny = experts if experts < 4 else 8 if experts >= 8 else 4
    for name in EXPERT_FIELDS:
        if isinstance(read(default, name), int):
            kw[name] = tiny
    for name in TOP_K_FIELDS:
        k = read(default, name)
        if isinstance(k, int) or (k is None and name in EVEN_IF_NONE):  # None: DeepSeek-V2's code still reads it
            kw[name] = min(tiny, 1 if k == 1 else 2)
    groups, picked = read(default, "n_group"), read(default, "topk_group")
    if isinstance(groups, int) and groups > 1 and isinstance(picked, int):
        kw["n_group"] = min(groups, max(1, tiny // 2))
        kw["topk_group"] = max(1, kw["n_group"] * picked // groups)
    if isinstance(dense := read(default, "first_k_dense_replace"), int):
        kw["first_k_dense_replace"] = min(dense, 1)  # of two layers: one dense, one MoE where the real has both


def _has(config: Any, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # a per-layer attribute: present, but not one global value
        return True


def _settable(config: Any, name: str) -> bool:
    computed = getattr(type(config), name, None)  # a property without a setter (Falcon's head_dim) is derived
    if isinstance(computed, property) and computed.fset is None:
        return False
    return _has(config, name) and (read(config, name) is not None or name in EVEN_IF_NONE)


def _per_layer(default: Any, kw: dict[str, Any], depth: int) -> None:
    """Per-layer lists cut to ``depth`` entries (two kinds kept, alternating, where there are two); dropout 0."""
    layers = read(default, "num_hidden_layers")
    for key, value in vars(default).items():
        cycled = key == "block_types"  # a pattern the layers repeat (RecurrentGemma's recurrent, recurrent, attention)
        per_layer = cycled or (layers and len(value) == layers) if isinstance(value, list | tuple) else False
        if not key.startswith("_") and per_layer:
            kw.setdefault(key, _cut(list(value), depth))
        if isinstance(value, float) and value and _DROPOUT.search(key):
            kw[key] = 0.0  # so that two train-mode forwards agree


def _two_layers(values: list[Any]) -> list[Any]:
    other = next((v for v in values[1:] if v != values[0]), None)
    return [values[0], other] if other is not None else values[:2]


def _cut(values: list[Any], depth: int) -> list[Any]:
    """``values``' two kinds repeated to ``depth`` layers; a list of layer indices (Kolibri-1.1's kv_source_layers:
    the earlier layer whose keys and values each layer reads) moves with its layers, so each repeat reads its own.

    Examples:
        >>> _cut(["sliding", "sliding", "full"], 4), _cut([0, 1, 2, 1], 4)
        (['sliding', 'full', 'sliding', 'full'], [0, 1, 2, 3])
    """
    two = _two_layers(values)
    cut = (two * depth)[:depth]
    if not _layer_indices(values):
        return cut
    return [v + len(two) * (i // len(two)) for i, v in enumerate(cut)]


def _layer_indices(values: list[Any]) -> bool:
    """Whether ``values`` name, for each layer, itself or an earlier layer it reads (not 0/1 flags, and not a set
    of layer indices that happens to list every layer, as Llama-4's moe_layers do)."""
    ints = all(type(v) is int and 0 <= v <= i for i, v in enumerate(values))
    return ints and max(values, default=0) > 1 and any(v < i for i, v in enumerate(values))


def tiny_kwargs(default: Any, *, layers: int = 2) -> dict[str, Any]:
    """Config keywords that shrink ``default`` (a family's default config) to ``layers`` layers, keeping its structure.

    Examples:
        >>> import transformers
        >>> kw = tiny_kwargs(transformers.GemmaConfig())  # 16 heads of 256 for a hidden size of 3072
        >>> kw["num_attention_heads"], kw["head_dim"], kw["hidden_size"]  # 4 of 16 for 48: the same 3/4
        (4, 16, 48)
    """
    kw = _flat(default, layers)
    _per_layer(default, kw, layers)
    _heterogeneous(default, kw, layers)
    return kw


def _flat(default: Any, layers: int) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    _attention(default, kw)
    _ssm(default, kw)
    _linear_attention(default, kw)
    _widths(default, kw)
    _experts(default, kw)
    kw |= FIXED | {"num_hidden_layers": layers}
    return {k: v for k, v in kw.items() if _settable(default, k)}


def _heterogeneous(default: Any, kw: dict[str, Any], depth: int) -> None:
    """A config whose layers override its fields (``per_layer_config``: Dots3-Note's sliding layers have 64 heads
    of 256 where its indexed ones have 128 of 192): each tiny layer keeps the overrides of the first real layer of
    its kind, shrunk as that layer's own config would be."""
    overrides = {int(i): o for i, o in (getattr(default, "to_dict", dict)().get("per_layer_config") or {}).items()}
    if not overrides:
        return
    kinds, tiny_kinds = read(default, "layer_types"), kw.get("layer_types")
    per_layer = {}
    for i in range(depth):
        real = kinds.index(tiny_kinds[i]) if kinds and tiny_kinds else i
        if real in overrides:
            shrunk = _flat(default.per_layer_config[real], depth)
            per_layer[i] = {k: shrunk.get(k, v) for k, v in overrides[real].items()}
    kw["per_layer_config"] = per_layer


# ---------------------------------------------------------------- the relations, named and checked


def _ratio(config: Any) -> float | str | None:
    heads, kv = read(config, "num_attention_heads"), kv_heads(config)
    if not isinstance(heads, int) or not isinstance(kv, int) or not kv:
        return None
    return "one KV head" if kv == 1 else heads / kv


def _head_dim_is_hidden_over_heads(config: Any) -> bool | None:
    if isinstance(read(config, "qk_rope_head_dim"), int):
        return None  # MLA: its head_dim is the rotary dim, unrelated to hidden/heads
    dim, hidden, heads = read(config, "head_dim"), read(config, "hidden_size"), read(config, "num_attention_heads")
    if not isinstance(dim, int):
        return True if isinstance(hidden, int) else None
    return dim * heads == hidden if isinstance(hidden, int) and isinstance(heads, int) else None


def _query_vs_value(config: Any) -> str | None:
    v = read(config, "v_head_dim")
    if not isinstance(v, int):
        return None
    nope, rope = read(config, "qk_nope_head_dim"), read(config, "qk_rope_head_dim")
    q = nope + rope if isinstance(nope, int) and isinstance(rope, int) else head_dim(config)
    return None if q is None else "<" if v < q else "=" if v == q else ">"


def _rotary(config: Any) -> float | None:
    rotary, dim = read(config, "rotary_dim"), head_dim(config)
    factor = read(config, "partial_rotary_factor")
    if isinstance(rotary, int) and dim:
        return rotary / dim
    return factor if isinstance(factor, float | int) else None


def _window_shorter_than_the_sequence(config: Any) -> bool | None:
    window = read(config, "sliding_window")
    return None if not isinstance(window, int) or window <= 0 else True


def _tiny_window(config: Any) -> bool | None:
    window = read(config, "sliding_window")
    return None if not isinstance(window, int) or window <= 0 else window < SEQ


def _shared_experts(config: Any) -> bool | None:
    shared = first(config, SHARED_FIELDS)
    return None if not isinstance(shared, int) else shared > 0


def _routes_to_several(config: Any) -> bool | None:
    k = first(config, TOP_K_FIELDS)
    return None if not isinstance(k, int) or first(config, EXPERT_FIELDS) is None else k > 1


def _tied(config: Any) -> bool | None:
    tied = read(config, "tie_word_embeddings")
    return tied if isinstance(tied, bool) else None


def _layer_kinds(config: Any) -> frozenset[str] | None:
    kinds = read(config, "layer_types")
    return frozenset(str(k) for k in kinds) if isinstance(kinds, list | tuple) and kinds else None


def _kinds_kept(want: frozenset[str], got: frozenset[str] | None) -> bool:
    # two layers keep two kinds of the default's (all of them where it has one or two)
    return got is not None and got <= want and len(got) == min(2, len(want))


def _width_ratios(config: Any) -> tuple[int, dict[str, int]] | None:
    hidden, found = read(config, "hidden_size"), widths(config)
    return (hidden, found) if isinstance(hidden, int) and hidden > 0 and found else None


def _widths_kept(want: tuple[int, dict[str, int]], got: tuple[int, dict[str, int]] | None) -> bool:
    # a tiny width is the real ratio times the tiny hidden size, a multiple of 16 (at least 16): within 16 of
    # it; 0 stays 0 (no shared expert)
    if got is None:
        return False
    (real_hidden, real), (hidden, tiny) = want, got
    return all(
        name in tiny and (tiny[name] == 0 if width <= 0 else abs(tiny[name] - width * hidden / real_hidden) <= 16)
        for name, width in real.items()
    )


def _equal(want: Any, got: Any) -> bool:
    if isinstance(want, float) and isinstance(got, float):
        return math.isclose(want, got, rel_tol=1e-6)
    return bool(want == got)


# name → (how the default reads, how the tiny config reads[, whether they agree: equal by default])
RELATIONS: dict[str, tuple[Callable[[Any], Any], ...]] = {
    "GQA ratio (query heads per KV head)": (_ratio, _ratio),
    "head_dim == hidden / heads": (_head_dim_is_hidden_over_heads, _head_dim_is_hidden_over_heads),
    "value head dim vs query head dim": (_query_vs_value, _query_vs_value),
    "partial rotary fraction": (_rotary, _rotary),
    "a window shorter than the sequence": (_window_shorter_than_the_sequence, _tiny_window),
    "shared experts": (_shared_experts, _shared_experts),
    "top-k over several experts": (_routes_to_several, _routes_to_several),
    "tied embeddings": (_tied, _tied),
    "layer kinds": (_layer_kinds, _layer_kinds, _kinds_kept),
    "feed-forward widths / hidden size": (_width_ratios, _width_ratios, _widths_kept),
}


def broken_relations(default: Any, tiny: Any) -> list[str]:
    """The relations of `RELATIONS` that ``tiny`` does not keep from ``default``, said with both values.

    Examples:
        >>> import transformers
        >>> broken_relations(transformers.LlamaConfig(), transformers.LlamaConfig(num_key_value_heads=8))
        ['GQA ratio (query heads per KV head): default 1.0, tiny 4.0']
    """
    broken = []
    for name, (of_default, of_tiny, *agree) in RELATIONS.items():
        want, got = of_default(default), of_tiny(tiny)
        if want is not None and not (agree[0] if agree else _equal)(want, got):
            broken.append(f"{name}: default {want}, tiny {got}")
    return broken
