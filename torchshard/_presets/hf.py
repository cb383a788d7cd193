"""Rules for Hugging Face transformers models: their own tp_plans, head-count checks, vocabulary FSDP."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from torchshard._base.errors import ShardingError, UnusedRuleWarning, raise_if_any
from torchshard._base.specs import entry_axes, spec_axes
from torchshard._base.validate import describe_mesh
from torchshard._presets.hf_plan import expert_patterns, from_hf_tp_plan, layout_problems, unmatched_entries
from torchshard._presets.tables import AxisName, expert_parallel, fsdp
from torchshard._sharding.rules import Rules, SpecTransform, TensorInfo

_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")


def _head_counts(config: Any) -> tuple[tuple[str, int], ...]:
    """(config field, value) of the head counts a TP axis must divide; absent or None fields are skipped.

    A heterogeneous config (transformers' ``per_layer_config``: Dots3-Note's layers have 128 or 64 heads) has
    no global count to read: each layer's counts are checked, named by their layer.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text.per_layer_config if getattr(text, "is_heterogeneous", False) is True else ()
    sources = [(f"per_layer_config[{i}].", layer) for i, layer in enumerate(layers)] or [("", text)]
    counts: dict[tuple[str, int], str] = {}
    for prefix, source in sources:
        for field in _HEAD_FIELDS:
            value = getattr(source, field, None)
            if isinstance(value, int) and not isinstance(value, bool):
                counts.setdefault((field, value), prefix + field)  # each distinct count once, at its first layer
    return tuple((name, value) for (_, value), name in counts.items())


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

    Examples:
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
        if set(spec_axes(spec)) & set(axes) or len(spec) > 2:
            return spec
        first = entry_axes(spec[0]) if spec else ()
        merged = first + axes
        if any(a not in info.mesh.shape for a in merged):
            return spec  # plan() reports the unknown axis
        if info.shape[0] % math.prod(info.mesh.shape[a] for a in merged):
            return spec  # the plain FSDP transform picks another dim
        return PartitionSpec(merged if len(merged) > 1 else merged[0], *spec[1:2])


def _vocab_names(model: Any) -> frozenset[str]:
    """State-dict names of the input embedding and output head weights."""
    tables = [getattr(model, f, lambda: None)() for f in ("get_input_embeddings", "get_output_embeddings")]
    ids = {id(t.weight) for t in tables if t is not None and isinstance(getattr(t, "weight", None), torch.Tensor)}
    named = model.named_parameters(remove_duplicate=False)
    return frozenset(name for name, p in named if id(p) in ids)


def _model_plans(model: Any) -> tuple[Mapping[str, str], Mapping[str, str]]:
    """The model's (tp_plan, ep_plan): its own (transformers ≥ 5: full names, the head too), else its config's."""
    if getattr(model, "config", None) is None:
        raise ShardingError(
            f"hf_rules() needs a transformers model (with .config), got {type(model).__name__}; "
            f"for a bare tp_plan dict use from_hf_tp_plan(tp_plan)"
        )
    tp_plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    ep_plan = getattr(model, "ep_plan", None) or getattr(model, "_ep_plan", None)
    return (
        tp_plan or getattr(model.config, "base_model_tp_plan", None) or {},
        ep_plan or getattr(model.config, "base_model_ep_plan", None) or {},
    )


def _present(model: Any, tp_plan: Mapping[str, str], axis: AxisName | None) -> Mapping[str, str]:
    """The entries that name something in ``model``; every entry that lays out nothing is a problem."""
    modules = dict(model.named_modules())
    tensors = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    tensors += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    raise_if_any(layout_problems(tp_plan, modules, tensors), header=f"{type(model).__name__}'s tp_plan")
    missing = unmatched_entries(tp_plan, [*modules, *tensors])
    if missing and axis is not None:
        # configs leave out modules their plan covers (dense MLPs when every layer is MoE, q_proj
        # under a q_lora_rank): a note, since each such entry would otherwise warn in plan()
        warnings.warn(
            f"{type(model).__name__}'s tp_plan entries {dict(missing)} match no module or tensor of this model "
            f"(its config leaves them out); they add no rule",
            UnusedRuleWarning,
            stacklevel=3,
        )
    return {k: s for k, s in tp_plan.items() if (k, s) not in missing}


def hf_rules(
    model: Any,
    *,
    axis: AxisName | None = "model",
    expert_axis: AxisName | None = None,
    fsdp_axis: AxisName | None = "data",
    fsdp_min_size: int = 2**12,
    replicate_unsupported: bool = False,
) -> Rules:
    """Rules for a transformers model: its own tp_plan over ``axis``, checked against its config, + FSDP.

    `plan` then also reports (with every other problem) head counts in the config that the
    ``axis`` size does not divide (see `validate_hf_config`). Works on ``meta`` models.
    Mixture-of-experts weights (``[experts, out, in]``) follow the plan's MoE styles over
    ``axis`` and, with ``expert_axis``, are split by expert over that axis too (expert
    parallelism: the stacked weights the model's ``ep_plan`` names).

    Args:
        model: a transformers ``PreTrainedModel`` (e.g. ``LlamaForCausalLM``).
        axis: the tensor-parallel mesh axis; None adds no tensor-parallel rules.
        expert_axis: split every stacked expert weight's expert dim over this axis; None for none.
        fsdp_axis: shard every big tensor's other dim over this axis; None for TP only.
        fsdp_min_size: tensors with fewer elements are not FSDP-sharded.
        replicate_unsupported: replicate modules whose tp style has no layout here instead of raising.

    Returns:
        ``from_hf_tp_plan(model.tp_plan) + fsdp(fsdp_axis)`` with the head-count check; the
        embedding and head put ``fsdp_axis`` on their vocabulary dim, so the batch stays sharded.
        Plan entries naming modules this config leaves out add no rule (one `UnusedRuleWarning`).

    Raises:
        ShardingError: ``model`` has no config or no tp_plan (when ``axis`` is set), a style cannot
            be expressed, an entry names a module without a tensor it could lay out, or
            ``expert_axis`` is set on a model without stacked expert weights.

    Examples:
        >>> model = LlamaForCausalLM(config)  # doctest: +SKIP
        >>> p = torchshard.plan(model, make_mesh({"data": 4, "model": 2}), hf_rules(model))  # doctest: +SKIP
    """
    tp_plan, ep_plan = _model_plans(model)
    rules = Rules()
    if axis is not None:
        if not tp_plan:
            raise ShardingError(
                f"{type(model).__name__} has no tensor-parallel plan (model.tp_plan and config.base_model_tp_plan "
                f"are empty); write tensor_parallel(colwise=[...], rowwise=[...]) rules for it, or use "
                f"hf_rules(model, axis=None) for FSDP alone"
            )
        present = _present(model, tp_plan, axis)
        rules = from_hf_tp_plan(present, axis=axis, replicate_unsupported=replicate_unsupported)
        rules += Rules(transforms=(HFHeads(axis, _head_counts(model.config)),))
    if expert_axis is not None:
        rules += _expert_rules(model, tp_plan, ep_plan, expert_axis)
    if fsdp_axis is None:
        return rules
    vocab = Rules(transforms=(VocabFSDP(_vocab_names(model), fsdp_axis, fsdp_min_size),))
    return rules + vocab + fsdp(fsdp_axis, fsdp_min_size)


def _expert_rules(model: Any, tp_plan: Mapping[str, str], ep_plan: Mapping[str, str], axis: AxisName) -> Rules:
    patterns = expert_patterns(ep_plan, tp_plan)
    if not patterns:
        stacked = [f"{n} {list(p.shape)}" for n, p in model.named_parameters() if p.ndim == 3]
        fix = (  # an MoE whose plans leave its stacked experts out (jetmoe) is not told it needs one
            f"it has 3-D weights ({', '.join(stacked[:2])}, ...): name its stacked expert tensors with "
            if stacked
            else "expert parallelism needs a mixture of experts, or name its expert tensors with "
        )
        raise ShardingError(
            f"hf_rules(expert_axis={axis!r}): {type(model).__name__} has no stacked expert weights in its ep_plan "
            f"or tp_plan (no 'grouped_gemm' or 'moe_tp_experts' entries); {fix}presets.expert_parallel(patterns)"
        )
    return expert_parallel(patterns, axis)
