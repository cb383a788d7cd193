"""Rules for Hugging Face transformers models: their own tp_plans, head-count checks, vocabulary FSDP."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from torchshard._errors import ShardingError, raise_if_any
from torchshard._presets import AxisName, fsdp, tensor_parallel
from torchshard._rules import Rules, SpecTransform, TensorInfo
from torchshard._specs import entry_axes, spec_axes
from torchshard._validate import describe_mesh

# transformers 4.x and 5.x style names; only the weight layout matters here (GSPMD places activations)
_HF_STYLES = {
    "colwise": "colwise",
    "colwise_rep": "colwise",
    "colwise_gather_output": "colwise",
    "embedding_colwise": "colwise",
    "local_colwise": "colwise",
    "rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "rowwise_split_input": "rowwise",
    "embedding_rowwise": "rowwise",
    "local_rowwise": "rowwise",
}
_HF_REPLICATE = {
    "replicate",
    "replicated_with_grad_allreduce",
    "all_reduce",
    "gather",
    "local",
    "sequence_parallel",
    "isolated",
    "ep_router",
}


def _hf_pattern(key: str) -> str:
    body = r"\d+".join(re.escape(part) for part in key.split("*"))
    return r"(?:.*\.)?" + body


def from_hf_tp_plan(
    tp_plan: Mapping[str, str], *, axis: AxisName = "model", replicate_unsupported: bool = False
) -> Rules:
    """Converts a transformers ``base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise"}``).

    Keys may be relative to the base model; they match names under any prefix (``model.``).

    Args:
        tp_plan: module pattern (``*`` = layer index) → HF style name.
        axis: the tensor-parallel mesh axis.
        replicate_unsupported: replicate modules whose style has no weight layout here
            instead of raising.

    Raises:
        ShardingError: every style that cannot be expressed, unless ``replicate_unsupported``.

    Example:
        >>> rules = from_hf_tp_plan({"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})
    """
    colwise, rowwise, problems = [], [], []
    for key, style in tp_plan.items():
        kind = _HF_STYLES.get(style)
        if kind == "colwise":
            colwise.append(_hf_pattern(key))
        elif kind == "rowwise":
            rowwise.append(_hf_pattern(key))
        elif style not in _HF_REPLICATE and not replicate_unsupported:
            problems.append(
                f"{key!r}: tp style {style!r} has no torchshard layout (supported: "
                f"{sorted(_HF_STYLES)}; no-weight styles {sorted(_HF_REPLICATE)}); pass "
                f"replicate_unsupported=True to replicate it"
            )
    raise_if_any(problems, header="unsupported HF tp_plan styles")
    return tensor_parallel(colwise, rowwise, axis=axis)


_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")


def _head_counts(config: Any) -> tuple[tuple[str, int], ...]:
    """(config field, value) of the head counts a TP axis must divide; absent or None fields are skipped."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = ((field, getattr(text, field, None)) for field in _HEAD_FIELDS)
    return tuple((f, v) for f, v in values if isinstance(v, int) and not isinstance(v, bool))


def _head_problems(counts: Sequence[tuple[str, int]], axis: AxisName, mesh: Mesh | AbstractMesh) -> list[str]:
    axes = entry_axes(axis)
    if not counts or any(a not in mesh.shape for a in axes):
        return []  # an unknown axis is reported by the TP rules' own validation
    size = math.prod(mesh.shape[a] for a in axes)
    common = math.gcd(*(v for _, v in counts))
    fits = [d for d in range(1, common + 1) if common % d == 0]
    return [
        f"config.{field}={value} is not divisible by the {axis!r} axis size {size} of {describe_mesh(mesh)}: "
        f"column-parallel q/k/v projections would split a head across devices (XLA then replicates q/k/v "
        f"in every attention layer, and transformers' own TP needs whole heads); use a {axis!r} axis size "
        f"in {fits}"
        for field, value in counts
        if value % size
    ]


@dataclasses.dataclass(frozen=True)
class HFHeads(SpecTransform):
    """Changes no spec; makes `plan` report head counts that the TP axis does not divide."""

    axis: AxisName
    counts: tuple[tuple[str, int], ...]

    @property
    def label(self) -> str:
        return f"hf-heads({self.axis!r})"

    def __call__(self, info: TensorInfo, spec: PartitionSpec) -> PartitionSpec:
        return spec

    def problems(self, mesh: Mesh | AbstractMesh) -> list[str]:
        return _head_problems(self.counts, self.axis, mesh)


def validate_hf_config(config: Any, mesh: Mesh | AbstractMesh, *, axis: AxisName = "model") -> None:
    """Checks that tensor parallelism over ``axis`` keeps whole attention heads on each device.

    ``num_attention_heads`` and ``num_key_value_heads`` (read from the text config) must be
    divisible by the axis size; the plan itself checks every weight's dims.

    Args:
        config: a transformers ``PretrainedConfig``.
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis.

    Raises:
        ShardingError: each config field the axis size does not divide, with the sizes that would work.

    Example:
        >>> validate_hf_config(LlamaConfig(num_attention_heads=32, num_key_value_heads=8), mesh)  # doctest: +SKIP
    """
    raise_if_any(
        _head_problems(_head_counts(config), axis, mesh),
        header=f"{type(config).__name__} cannot be tensor-parallel over {axis!r} on {describe_mesh(mesh)}",
    )


@dataclasses.dataclass(frozen=True)
class VocabFSDP(SpecTransform):
    """FSDP for embedding tables and LM heads: the vocabulary dim takes ``axis`` (next to any TP axis).

    An embedding lookup's output inherits the table's hidden-dim sharding; sharded over the
    batch axis, GSPMD would gather the whole batch onto every device (no data parallelism left).
    """

    names: frozenset[str]
    axis: AxisName
    min_size: int

    @property
    def label(self) -> str:
        return f"+fsdp({self.axis!r}, vocabulary dim)"

    def __call__(self, info: TensorInfo, spec: PartitionSpec) -> PartitionSpec:
        axes = entry_axes(self.axis)
        if info.name not in self.names or len(info.shape) != 2 or math.prod(info.shape) < self.min_size:
            return spec
        if set(spec_axes(spec)) & set(axes) or any(a not in info.mesh.shape for a in axes) or len(spec) > 2:
            return spec
        first = entry_axes(spec[0]) if spec else ()
        merged = first + axes
        if info.shape[0] % math.prod(info.mesh.shape[a] for a in merged):
            return spec  # the plain FSDP transform picks another dim
        return PartitionSpec(merged if len(merged) > 1 else merged[0], *spec[1:2])


def _vocab_names(model: Any) -> frozenset[str]:
    """State-dict names of the input embedding and output head weights."""
    tables = [getattr(model, f, lambda: None)() for f in ("get_input_embeddings", "get_output_embeddings")]
    ids = {id(t.weight) for t in tables if t is not None and isinstance(getattr(t, "weight", None), torch.Tensor)}
    named = model.named_parameters(remove_duplicate=False)
    return frozenset(name for name, p in named if id(p) in ids)


def _model_tp_plan(model: Any) -> Mapping[str, str]:
    if getattr(model, "config", None) is None:
        raise ShardingError(
            f"hf_rules() needs a transformers model (with .config), got {type(model).__name__}; "
            f"for a bare tp_plan dict use from_hf_tp_plan(tp_plan)"
        )
    # the model's own plan (transformers ≥ 5) has full names and the head (lm_head); the config's
    # base_model_tp_plan only covers the base model
    tp_plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    tp_plan = tp_plan or getattr(model.config, "base_model_tp_plan", None)
    if not tp_plan:
        raise ShardingError(
            f"{type(model).__name__} has no tensor-parallel plan (model.tp_plan and config.base_model_tp_plan are "
            f"empty); write tensor_parallel(colwise=[...], rowwise=[...]) rules for it, or use fsdp() alone"
        )
    return tp_plan


def hf_rules(
    model: Any,
    *,
    axis: AxisName = "model",
    fsdp_axis: AxisName | None = "data",
    fsdp_min_size: int = 2**12,
    replicate_unsupported: bool = False,
) -> Rules:
    """Rules for a transformers model: its own tp_plan over ``axis``, checked against its config, + FSDP.

    `plan` then also reports (with every other problem) head counts in the config that the
    ``axis`` size does not divide (see `validate_hf_config`). Works on ``meta`` models.

    Args:
        model: a transformers ``PreTrainedModel`` (e.g. ``LlamaForCausalLM``).
        axis: the tensor-parallel mesh axis.
        fsdp_axis: shard every big tensor's other dim over this axis; None for TP only.
        fsdp_min_size: tensors with fewer elements are not FSDP-sharded.
        replicate_unsupported: replicate modules whose tp style has no layout here instead of raising.

    Returns:
        ``from_hf_tp_plan(model.tp_plan) + fsdp(fsdp_axis)`` with the head-count check; the
        embedding and head put ``fsdp_axis`` on their vocabulary dim, so the batch stays sharded.

    Raises:
        ShardingError: ``model`` has no config or no tp_plan, or a style cannot be expressed.

    Example:
        >>> model = LlamaForCausalLM(config)  # doctest: +SKIP
        >>> p = torchshard.plan(model, make_mesh({"data": 4, "model": 2}), hf_rules(model))  # doctest: +SKIP
    """
    rules = from_hf_tp_plan(_model_tp_plan(model), axis=axis, replicate_unsupported=replicate_unsupported)
    rules += Rules(transforms=(HFHeads(axis, _head_counts(model.config)),))
    if fsdp_axis is None:
        return rules
    vocab = Rules(transforms=(VocabFSDP(_vocab_names(model), fsdp_axis, fsdp_min_size),))
    return rules + vocab + fsdp(fsdp_axis, fsdp_min_size)
