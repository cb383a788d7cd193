"""transformers' tp_plan and ep_plan styles → torchshard rules: dense, packed and mixture-of-experts weights."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torchshard._base.errors import raise_if_any
from torchshard._base.validate import compiled
from torchshard._presets.tables import PEFT_BASE, AxisName, TensorLayout, lora_rules
from torchshard._sharding.rules import Rule, Rules

# transformers 4.x and 5.x style names → the weight layout (GSPMD places activations). Packed
# styles hold two projections (gate | up) along the split dim: transformers gives each device
# matching halves of both (a strided shard); a PartitionSpec splits the dim in contiguous blocks,
# which is as correct (GSPMD moves the halves where the gate meets the up projection) at the cost
# of a collective-permute per MoE layer and step.
_HF_STYLES = {
    "colwise": "colwise",
    "colwise_rep": "colwise",
    "colwise_gather_output": "colwise",
    "embedding_colwise": "colwise",
    "local_colwise": "colwise",
    "packed_colwise": "colwise",
    "rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "rowwise_split_input": "rowwise",
    "embedding_rowwise": "rowwise",
    "local_rowwise": "rowwise",
    "packed_rowwise": "rowwise",
}
# styles that only hook a module's forward (all-reduces, input scaling) and leave its tensors to the
# other rules: GSPMD derives those collectives from the weights' layouts
_HF_NO_LAYOUT = {
    "replicate",
    "replicated_with_grad_allreduce",
    "all_reduce",
    "gather",
    "local",
    "local_params",
    "sequence_parallel",
    "isolated",
    "ep_router",
    "mla_kv_a_proj",
    "moe_tp_experts",
    "moe_identity_expert",
}
# ep_plan styles of the stacked expert weights ([experts, out, in])
_HF_EXPERT_STYLES = {"grouped_gemm"}


def hf_pattern(key: str) -> str:
    """A tp_plan key (``layers.*.mlp.up_proj``, ``*`` = a layer index) as a regex under any prefix."""
    body = r"\d+".join(re.escape(part) for part in key.split("*"))
    return r"(?:.*\.)?" + body


def _tensor_pattern(key: str) -> str:
    # a key names a module (its weight and bias are laid out) or a bare parameter (stacked experts, sinks)
    return hf_pattern(key) + rf"(?:{PEFT_BASE}(?:\.weight|\.bias))?"  # peft's wrapped layer too


def from_hf_tp_plan(
    tp_plan: Mapping[str, str], *, axis: AxisName = "model", replicate_unsupported: bool = False
) -> Rules:
    """Converts a transformers ``base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise"}``).

    Keys may be relative to the base model; they match names under any prefix (``model.``). A key
    names a module (its ``weight`` and ``bias`` are laid out) or a bare parameter, such as the
    stacked expert weights ``[experts, out, in]`` of a mixture of experts (colwise splits ``out``,
    rowwise ``in``). Packed styles (``packed_colwise``: gate and up along one dim) split that dim
    in contiguous blocks.

    Args:
        tp_plan: module or parameter pattern (``*`` = layer index) → HF style name.
        axis: the tensor-parallel mesh axis.
        replicate_unsupported: replicate modules whose style has no weight layout here
            instead of raising.

    Raises:
        ShardingError: every style that cannot be expressed, unless ``replicate_unsupported``.

    Examples:
        >>> rules = from_hf_tp_plan({"layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        ...                          "layers.*.mlp.experts.down_proj": "rowwise"})
        >>> moe = torch.nn.Module()
        >>> moe.experts = torch.nn.Module()
        >>> moe.experts.gate_up_proj = torch.nn.Parameter(torch.ones(4, 64, 16))
        >>> moe.experts.down_proj = torch.nn.Parameter(torch.ones(4, 16, 32))
        >>> layers = torch.nn.Module()
        >>> layers.layers = torch.nn.ModuleList([torch.nn.Module()])
        >>> layers.layers[0].mlp = moe
        >>> p = ts.plan(layers, ts.make_mesh({"data": 4, "model": 2}), rules)
        >>> p.spec("layers.0.mlp.experts.gate_up_proj"), p.spec("layers.0.mlp.experts.down_proj")
        (P(None, 'model', None), P(None, None, 'model'))
    """
    rows, problems = [], []
    for key, style in tp_plan.items():
        kind = _HF_STYLES.get(style)
        if kind is not None:
            rows.append(Rule(_tensor_pattern(key), TensorLayout(kind, axis, "tensor"), f"tp:{style}"))
            rows += lora_rules(hf_pattern(key), kind, axis)
        elif style not in _HF_NO_LAYOUT and not replicate_unsupported:
            problems.append(
                f"{key!r}: tp style {style!r} has no torchshard layout (supported: "
                f"{sorted(_HF_STYLES)}; styles without a weight layout {sorted(_HF_NO_LAYOUT)}); pass "
                f"replicate_unsupported=True to replicate it"
            )
    raise_if_any(problems, header="unsupported HF tp_plan styles")
    return Rules(rows)


def expert_patterns(ep_plan: Mapping[str, str] | None, tp_plan: Mapping[str, str]) -> tuple[str, ...]:
    """Patterns of the stacked expert weights: the ep_plan's ``grouped_gemm`` keys, else the tp_plan's
    parameters under a ``moe_tp_experts`` module."""
    keys = [k for k, style in (ep_plan or {}).items() if style in _HF_EXPERT_STYLES]
    if not keys:
        experts = [k for k, style in tp_plan.items() if style == "moe_tp_experts"]
        keys = [k for k in tp_plan if any(k.startswith(e + ".") for e in experts)]
    return tuple(hf_pattern(k) for k in keys)


def unmatched_entries(plan: Mapping[str, str], names: Sequence[str]) -> list[tuple[str, str]]:
    """(key, style) of plan entries that match no module or tensor in ``names``."""
    return [(k, s) for k, s in plan.items() if not any(compiled(hf_pattern(k)).fullmatch(n) for n in names)]


def layout_problems(tp_plan: Mapping[str, str], modules: Mapping[str, Any], tensors: Sequence[str]) -> list[str]:
    """Entries with a weight layout that name a module none of whose tensors it lays out.

    The layout rule matches the module's ``weight``/``bias`` (or a bare parameter): a module holding
    its tensors under other names would otherwise be silently replicated.
    """
    problems = []
    for key, style in tp_plan.items():
        if style not in _HF_STYLES:
            continue
        owners = [n for n in modules if compiled(hf_pattern(key)).fullmatch(n)]
        laid_out = [t for t in tensors if compiled(_tensor_pattern(key)).fullmatch(t)]
        if owners and not laid_out:
            owner = owners[0]
            own = sorted(t[len(owner) + 1 :] for t in tensors if t.startswith(owner + "."))
            held = f"holds {own[:6]} under it" if own else "holds no tensors"
            problems.append(
                f"tp_plan entry {key!r} ({style}) names module {owner!r} ({type(modules[owner]).__name__}), which "
                f"{held} but no weight or bias of its own (nor a peft base_layer's) to lay out; add a rule for "
                f"them, e.g. ({owner.replace('.', chr(92) + '.')!r} + r'\\.NAME', spec)"
            )
    return problems
