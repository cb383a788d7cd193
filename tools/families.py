"""Tiny configs of transformers causal-LM families, shared by the tests and the conformance matrix.

A family is built from its own config class, shrunk from its default config by `tools.tiny`: depth,
width, vocabulary and expert count shrink; the relations between fields that make a family what it is
stay (value vs query head dims, head_dim vs hidden/heads, GQA ratios, partial rotary, windows
shorter than the sequence, shared experts and top-k, tied embeddings). `causal_lm_types` lists every
causal-LM family the installed transformers offers; `family` gives any of them, with the overrides
of DENSE/MOE where a family needs one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tools.tiny import tiny_kwargs


@dataclasses.dataclass(frozen=True)
class Family:
    """A transformers model type, its tiny-config overrides and what its training test needs."""

    model_type: str
    moe: bool = False
    extra: tuple[tuple[str, Any], ...] = ()  # config overrides beyond `tools.tiny`'s
    mismatch: str = ""  # why its losses differ from eager torch (an expected failure), if they do
    samples: str = ""  # why its train mode draws random numbers (a sampling router): it then trains in eval mode


def config(family: Family, *, layers: int = 2) -> Any:
    """The family's tiny config: `tools.tiny.tiny_kwargs` of its default config, then the family's overrides."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_class = getattr(transformers, CONFIG_MAPPING_NAMES[family.model_type])
    default = config_class()
    extra = _deepened(default, family.extra, layers)
    tiny = _without_aliases(tiny_kwargs(default, layers=layers), extra, getattr(config_class, "attribute_map", {}))
    return config_class(**(tiny | extra))


def _without_aliases(tiny: dict[str, Any], extra: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``tiny`` without the fields that name one of ``extra``'s under another name (``aliases``, a config's
    attribute_map): a config sets an alias after the field, so tiny's ``num_local_experts=1`` would undo a
    family's ``num_experts=8``.

    Examples:
        >>> _without_aliases({"num_local_experts": 1, "hidden_size": 64}, {"num_experts": 8},
        ...                  {"num_local_experts": "num_experts"})
        {'hidden_size': 64}
    """
    field = {name: aliases.get(name, name) for name in (*tiny, *extra)}
    overridden = {field[name] for name in extra}
    return {k: v for k, v in tiny.items() if k in extra or field[k] not in overridden}


def _deepened(default: Any, extra: tuple[tuple[str, Any], ...], layers: int) -> dict[str, Any]:
    """The family's overrides, its per-layer lists (written for two layers) repeated to ``layers``.

    Examples:
        >>> class Default:
        ...     num_hidden_layers, layer_types, pattern = 3, ["a", "a", "a"], [1, 2]
        >>> _deepened(Default(), (("layer_types", ["a", "b"]), ("pattern", [1, 2])), 4)
        {'layer_types': ['a', 'b', 'a', 'b'], 'pattern': [1, 2]}
    """
    depth = getattr(default, "num_hidden_layers", None)

    def per_layer(key: str) -> bool:
        value = getattr(default, key, None)
        return isinstance(value, list | tuple) and len(value) == depth

    return {k: (list(v) * layers)[:layers] if isinstance(v, list | tuple) and per_layer(k) else v for k, v in extra}


def build(family: Family, *, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """The family's causal LM (its base model where it has none) on CPU, seeded."""
    import transformers
    from transformers.models.auto import modeling_auto

    built = config(family, layers=layers)
    name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family.model_type)
    torch.manual_seed(seed)
    model = getattr(transformers, name)(built)
    _randomize_zero_routers(model)
    return model


def _randomize_zero_routers(model: torch.nn.Module) -> None:
    # a zero-initialised router (AFMoE) ties every expert score, and torch and JAX break top-k ties
    # differently: small random weights make the comparison meaningful
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            routes = p.ndim == 2 and ("router" in name or name.endswith("gate.weight"))
            if routes and p.numel() and not p.is_meta and not p.any():
                p.normal_(std=0.02, generator=gen)


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The causal LM loss with the KV cache off, as in training (hybrid models' conv caches write
    through views torchax cannot ``copy_`` into)."""
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _f(model_type: str, *, moe: bool = False, mismatch: str = "", **extra: Any) -> Family:
    return Family(model_type, moe, tuple(extra.items()), mismatch)


# causal LMs of transformers 5.23 with a tp_plan that build from a tiny config
DENSE = [
    *(_f(t) for t in ("apertus", "arcee", "cohere", "cohere2", "cwm", "doge", "ernie4_5", "exaone4", "gemma",
                      "gemma2", "gemma3_text", "glm", "glm4", "gpt_neox", "granite", "granite_swa", "helium",
                      "hrm_text", "hyperclovax", "jais2", "llama", "minicpm3", "ministral", "ministral3", "mistral",
                      "nanochat", "olmo", "olmo2", "olmo3", "phi", "phi3", "qwen2", "qwen3", "seed_oss", "smollm3",
                      "starcoder2", "vaultgemma", "youtu")),
    _f("olmo_hybrid"),
]  # fmt: skip
MOE = [
    *(_f(t, moe=True) for t in ("afmoe", "aria_text", "axk1", "axk2", "beam", "cohere2_moe", "deepseek_v2",
                                "deepseek_v3", "deepseek_v4", "ernie4_5_moe", "exaone_moe",
                                "flex_olmo", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe",
                                "granitemoe_swa", "granitemoeshared", "hy_v3", "hy_v4",
                                "inkling_text", "kolibri1", "laguna", "llama4_text", "mellum", "mimo_v2_flash",
                                "minimax", "minimax_m2", "minimax_m3_vl_text", "mixtral", "olmoe", "qwen2_moe",
                                "qwen3_moe", "solar_open")),
    # its default config has one expert, top-1 (a dense MLP); Hunyuan-A13B routes each token to 8 of 64
    _f("hunyuan_v1_moe", moe=True, num_experts=8, moe_topk=2),
    _f("deepseek_v32", moe=True),  # its indexer keeps every key (tools.tiny.FIXED's index_topk)
    _f("flint"),  # an MoE family whose 2-layer config builds dense MLPs only (no stacked experts)
    _f("bailing_hybrid", moe=True),
    _f("granitemoehybrid", moe=True, layer_types=["full_attention", "linear_attention"]),
    _f("jamba", moe=True, attn_layer_period=2, attn_layer_offset=0),
]  # fmt: skip
_TINY_BLOCK = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
    "num_hidden_layers": 2,
}
# families outside the two lists whose config needs more than `tools.tiny` to be tiny
OTHER = [
    # byte latent transformer: four nested configs (tools.tiny reaches only the outer one: 25 global layers of
    # 2048 and a 500,002-row hash embedding would be built) and a hash-embedding vocabulary of its own
    _f("blt", encoder_hash_byte_group_vocab=256,
       encoder_config=_TINY_BLOCK | {"hidden_size_global": 64, "num_hidden_layers": 1},
       decoder_config=_TINY_BLOCK | {"hidden_size_global": 64},
       global_config=_TINY_BLOCK, patcher_config=_TINY_BLOCK),
    # Kimi delta attention sizes itself by fields of its own (32 heads of 128 by default: a 12,288-channel
    # conv beside hidden 64); its reference chunked kernel holds [batch, heads, chunks, 64, 64, head_dim]
    # float32 decays, 256 MiB a device under data=2 × expert=4 and 15 GB for the 8 simulated devices
    _f("kimi_linear", moe=True, linear_num_heads=4, linear_head_dim=16),
    # Kolibri-1.1 (transformers 5.25) rounds keys and values to NVFP4, which needs a head_dim that is a multiple of
    # 16: tools.tiny gives its 12 query heads per KV head (24 tiny ones) heads of 8
    _f("kolibri1_1", moe=True, head_dim=16),
]  # fmt: skip
# MoE families whose experts module is not called with the router's choice, so the Trainer leaves
# token movement to the plan's sharding (ExpertDispatch's default falls back)
NO_DISPATCH = {"llama4_text": "Llama4TextExperts.forward(hidden_states) takes rows already grouped by expert"}
# run by default (TORCHSHARD_FAMILIES=all runs every family): a subclassed embedding, a fused qkv,
# packed MoE experts, MoE with a shared expert and multi-head latent attention
REPRESENTATIVE = ("gemma2", "gpt_neox", "mixtral", "qwen3_moe", "deepseek_v3")


def with_router_logits(model_type: str) -> Family:
    """The table's MoE family with output_router_logits=True and a weighty aux loss (it takes part in the loss)."""
    base = next(f for f in MOE if f.model_type == model_type)
    return Family(model_type, True, (*base.extra, ("output_router_logits", True), ("router_aux_loss_coef", 0.5)))


def loss_and_aux(model: torch.nn.Module, ids: torch.Tensor):
    """transformers' own LM loss (the aux loss included) and the aux loss as a metric."""
    out = model(input_ids=ids, labels=ids)
    return out.loss, {"aux_loss": out.aux_loss}


def causal_lm_types() -> list[str]:
    """Every model type transformers' AutoModelForCausalLM maps, sorted (multimodal and encoder ones too)."""
    from transformers.models.auto import modeling_auto

    return sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def family(model_type: str) -> Family:
    """The family of DENSE/MOE/OTHER (with its overrides) when it is there, else one without overrides.

    A family outside the two lists is MoE when its tiny model has stacked expert weights (`has_experts`).
    """
    known = {f.model_type: f for f in DENSE + MOE + OTHER}
    found = known.get(model_type) or Family(model_type)
    return dataclasses.replace(found, samples=SAMPLES.get(model_type, ""))


# routers that sample in train mode: torch's and JAX's random streams differ, so no step could equal eager's
SAMPLES = {"phimoe": "its sparsemixer router samples with torch.rand_like in train mode"}


# families whose torchshard step differs from eager torch only under the suite's fast-compiling XLA flags
# (conftest.FAST_COMPILE), which users never set: the matrix runs them with XLA's defaults, as users do
# (tools/conformance.py's pool starts their worker so), and says why here
XLA_DEFAULTS = {
    "xlstm": "under --xla_backend_optimization_level=0 its third AdamW step is NaN (losses 5.066, 5.000, nan); "
    "with XLA's defaults it equals eager torch to 8.6e-07",
}


def has_experts(model: torch.nn.Module) -> bool:
    """Whether ``model`` keeps its experts' weights stacked ``[experts, ...]`` (what expert parallelism splits)."""
    return any(p.ndim == 3 and "experts" in name for name, p in model.named_parameters())


class _Factories:
    """``FACTORIES.<model_type>``: a no-argument builder of that family, for ``python -m torchshard plan``."""

    def __getattr__(self, model_type: str) -> Any:
        if model_type.startswith("_"):
            raise AttributeError(model_type)
        return lambda: build(family(model_type))


FACTORIES = _Factories()
