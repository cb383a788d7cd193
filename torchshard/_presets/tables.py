"""Ready-made rule tables: replicated, data parallel, FSDP and tensor parallel."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence

import torch
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from torchshard._base.specs import entry_axes, spec_axes
from torchshard._base.validate import closest_names, compiled, describe_mesh, int_problems, raise_for_arguments
from torchshard._sharding.rules import Rule, Rules, SpecTransform, TensorInfo

AxisName = str | tuple[str, ...]


def replicated() -> Rules:
    """Every tensor replicated on every device.

    Examples:
        >>> replicated().spec_for("anything")
        P()
    """
    return Rules([(r".*", PartitionSpec())], source="replicated")


def data_parallel() -> Rules:
    """Data parallelism: parameters replicated, only the batch is sharded (by the Trainer).

    Examples:
        >>> data_parallel().spec_for("fc.weight")
        P()
    """
    return Rules([(r".*", PartitionSpec())], source="data_parallel")


def axis_problems(what: str, axis: AxisName, mesh: Mesh | AbstractMesh) -> list[str]:
    """A preset's axis names that ``mesh`` lacks."""
    where = describe_mesh(mesh)
    return [
        f"{what} axis {a!r} is not an axis of {where}; use one of {list(mesh.shape)}"
        for a in entry_axes(axis)
        if a not in mesh.shape
    ]


@dataclasses.dataclass(frozen=True)
class FSDP(SpecTransform):
    """Adds ``axis`` to the largest still-unsharded dim of each tensor with ≥ ``min_size`` elements."""

    axis: AxisName = "data"
    min_size: int = 2**12

    @property
    def label(self) -> str:
        return f"+fsdp({self.axis!r})"

    def __call__(self, info: TensorInfo, spec: PartitionSpec) -> PartitionSpec:
        axes = entry_axes(self.axis)
        if math.prod(info.shape) < self.min_size or set(spec_axes(spec)) & set(axes):
            return spec
        if any(a not in info.mesh.shape for a in axes) or len(spec) > len(info.shape):
            return spec  # `problems` / plan validation report these
        size = math.prod(info.mesh.shape[a] for a in axes)
        entries = list(spec) + [None] * (len(info.shape) - len(spec))
        free = [d for d, e in enumerate(entries) if e is None and info.shape[d] % size == 0]
        if not free:
            return spec
        dim = max(free, key=lambda d: (info.shape[d], -d))
        entries[dim] = self.axis
        return PartitionSpec(*entries)

    def problems(self, mesh: Mesh | AbstractMesh) -> list[str]:
        return axis_problems("fsdp", self.axis, mesh)


def fsdp(axis: AxisName = "data", min_size: int = 2**12) -> Rules:
    """Fully-sharded data parallelism: shard big tensors' largest divisible dim over ``axis``.

    Combine with other rules by addition: ``tensor_parallel(...) + fsdp()`` shards each
    tensor over the TP axis first and puts the FSDP axis on another dim.

    Args:
        axis: mesh axis (or tuple of axes) to shard over.
        min_size: tensors with fewer elements stay replicated.

    Returns:
        Rules holding only the FSDP transform (unmatched tensors start replicated).

    Raises:
        ArgumentError: ``min_size`` is not an int ≥ 0.

    Examples:
        >>> rules = tensor_parallel(colwise=["fc1"], rowwise=["fc2"]) + fsdp("data")
        >>> rules.transforms[0].label
        "+fsdp('data')"
    """
    raise_for_arguments(int_problems("min_size", min_size, minimum=0), header="invalid fsdp() arguments")
    return Rules(transforms=(FSDP(axis, min_size),))


@dataclasses.dataclass(frozen=True)
class ExpertParallel(SpecTransform):
    """Puts ``axis`` on dim 0 (the experts) of every tensor whose name fullmatches one of ``patterns``.

    It composes with the spec a rule chose: tensor-parallel experts ``P(None, "model", None)``
    become ``P("expert", "model", None)``; an FSDP transform after it then picks another dim.
    """

    patterns: tuple[str, ...]
    axis: AxisName

    @property
    def label(self) -> str:
        return f"+experts({self.axis!r})"

    def __call__(self, info: TensorInfo, spec: PartitionSpec) -> PartitionSpec:
        axes = entry_axes(self.axis)
        if not info.shape or not any(compiled(p).fullmatch(info.name) for p in self.patterns):
            return spec
        if set(spec_axes(spec)) & set(axes) or len(spec) > len(info.shape):
            return spec  # already there, or a rank problem plan reports
        entries = list(spec) + [None] * (len(info.shape) - len(spec))
        merged = axes + entry_axes(entries[0])
        entries[0] = merged if len(merged) > 1 else merged[0]
        return PartitionSpec(*entries)  # plan reports an expert count the axis does not divide

    def problems(self, mesh: Mesh | AbstractMesh) -> list[str]:
        return axis_problems("expert_parallel", self.axis, mesh)

    def name_problems(self, names: Sequence[str]) -> list[str]:
        return [
            f"expert_parallel pattern {p!r} matches no tensor of the model (closest names: "
            f"{closest_names(p, names)}); name the stacked "
            f"expert weights, e.g. r'.*experts\\.gate_up_proj'"
            for p in self.patterns
            if not any(compiled(p).fullmatch(n) for n in names)
        ]


def expert_parallel(patterns: str | Sequence[str], axis: AxisName = "expert") -> Rules:
    """Expert parallelism: each stacked expert weight ``[experts, ...]`` is split by expert over ``axis``.

    For mixture-of-experts modules that hold their experts as one tensor per projection
    (``[experts, out, in]``, as transformers' do); experts kept as a ``ModuleList`` of separate
    Linears cannot be split by expert. Add it to other rules: ``expert_parallel(...) + fsdp()``.

    Args:
        patterns: regexes fullmatching the stacked expert tensors' state_dict names.
        axis: the mesh axis the experts are split over (it must divide the expert count).

    Returns:
        Rules with one transform; `plan` reports an unknown axis, an expert count the axis does
        not divide and a pattern that matches no tensor, with every other problem.

    Examples:
        >>> moe = torch.nn.Module()
        >>> moe.w_in, moe.w_out = torch.nn.Parameter(torch.ones(4, 32, 16)), torch.nn.Parameter(torch.ones(4, 16, 32))
        >>> rules = expert_parallel([r"w_in", r"w_out"]) + fsdp(min_size=1)
        >>> p = ts.plan(moe, ts.make_mesh({"expert": 4, "data": 2}), rules)
        >>> p.spec("w_in"), p.spec("w_out")
        (P('expert', 'data', None), P('expert', None, 'data'))
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    Rules([(p, ()) for p in patterns])  # validates the regexes with a clear error
    return Rules(transforms=(ExpertParallel(tuple(patterns), axis),))


def is_embedding(module_type: type | None) -> bool:
    """``torch.nn.Embedding`` or a subclass (e.g. Gemma's scaled word embedding)."""
    return module_type is not None and issubclass(module_type, torch.nn.Embedding)


def is_conv1d(module_type: type | None) -> bool:
    """transformers' ``Conv1D`` (GPT-2) or a subclass, recognised without importing transformers."""
    # a module of that class exists only once transformers is imported, so planning never imports it
    owner = sys.modules.get("transformers.pytorch_utils")
    return module_type is not None and owner is not None and issubclass(module_type, owner.Conv1D)


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Shape-aware TP spec: ``colwise`` shards outputs, ``rowwise`` inputs, in the owner's layout.

    ``param`` is ``"weight"``, ``"bias"`` or ``"tensor"`` (a bare parameter such as stacked expert
    weights: laid out like a weight, or like a bias when 1-D).
    """

    style: str
    axis: AxisName
    param: str

    @property
    def label(self) -> str:
        return f"{self.style}({self.axis!r})"

    def __call__(self, info: TensorInfo) -> PartitionSpec:
        if self.param == "bias" or (self.param == "tensor" and len(info.shape) == 1):
            return PartitionSpec(self.axis) if self.style == "colwise" else PartitionSpec()
        # torch Linear is [out, in]; Conv1D is [in, out]; Embedding is [num, dim], so colwise
        # splits its dim and rowwise its vocabulary; stacked experts are [experts, out, in]
        transposed = is_conv1d(info.module_type) or is_embedding(info.module_type)
        out_dim, in_dim = (1, 2) if len(info.shape) == 3 else (1, 0) if transposed else (0, 1)
        dim = out_dim if self.style == "colwise" else in_dim
        # a module with a 1-d weight (e.g. LayerNorm) yields a spec longer than its rank, which plan reports
        entries: list[AxisName | None] = [None] * max(len(info.shape), dim + 1)
        entries[dim] = self.axis
        return PartitionSpec(*entries)


# peft's LoRA wraps a Linear as ``base_layer`` + ``lora_A.<adapter>`` ([r, in]) + ``lora_B.<adapter>`` ([out, r])
PEFT_BASE = r"(?:\.base_layer)?"  # between a module's name and its weight/bias: the wrapped layer's are laid out alike
_PEFT_FACTORS = {"colwise": (r"\.lora_B\.[^.]+\.weight", r"\.lora_A\.[^.]+\.weight"),
                 "rowwise": (r"\.lora_A\.[^.]+\.weight", r"\.lora_B\.[^.]+\.weight")}  # fmt: skip


def lora_rules(head: str, style: str, axis: AxisName) -> list[Rule]:
    """Rules for the LoRA factors of a peft-wrapped module matching ``head``.

    The factor on the base weight's split dim is split like it (``lora_B [out, r]`` of a colwise
    layer, ``lora_A [r, in]`` of a rowwise one); the other factor is replicated.
    """
    split, whole = _PEFT_FACTORS[style]
    return [
        Rule(head + split, TensorLayout(style, axis, "weight"), f"tp:{style} (LoRA)", warn_unused=False),
        Rule(head + whole, PartitionSpec(), f"tp:{style} (LoRA, replicated)", warn_unused=False),
    ]


def tensor_parallel(colwise: Sequence[str] = (), rowwise: Sequence[str] = (), *, axis: AxisName = "model") -> Rules:
    """Megatron-style tensor parallelism; patterns name *modules* (``Linear``/``Embedding``).

    ``colwise`` Linear: weight ``[out, in]`` → ``(axis, None)``, bias → ``(axis,)``.
    ``rowwise`` Linear: weight → ``(None, axis)``, bias replicated. ``Embedding`` (``[num, dim]``):
    colwise shards ``dim``, rowwise shards the vocabulary. Subclasses count as their base. A
    module peft's LoRA wrapped lays out its ``base_layer`` so, its ``lora_B`` (colwise) or
    ``lora_A`` (rowwise) split on the same dim, the other factor replicated.

    Args:
        colwise: regexes of module names whose outputs are split over ``axis``.
        rowwise: regexes of module names whose inputs are split over ``axis``.
        axis: the tensor-parallel mesh axis.

    Examples:
        >>> rules = tensor_parallel(colwise=[r"layers\\.\\d+\\.up"], rowwise=[r"layers\\.\\d+\\.down"])
        >>> [rule.pattern for rule in rules][0]  # its weight, or that of the layer peft wrapped in it
        '(?:layers\\\\.\\\\d+\\\\.up)(?:\\\\.base_layer)?\\\\.weight'
    """
    rows = []
    for style, patterns in (("colwise", colwise), ("rowwise", rowwise)):
        if isinstance(patterns, str):
            patterns = [patterns]
        for pattern in patterns:
            Rules([(pattern, ())])  # validates the regex with a clear error
            head = f"(?:{pattern})"
            rows.append(Rule(head + PEFT_BASE + r"\.weight", TensorLayout(style, axis, "weight"), f"tp:{style}"))
            rows.append(
                Rule(head + PEFT_BASE + r"\.bias", TensorLayout(style, axis, "bias"), f"tp:{style}", warn_unused=False)
            )
            rows += lora_rules(head, style, axis)
    return Rules(rows)


# Module names that Megatron-style TP splits by output (colwise) or by input (rowwise) in common model code.
COMMON_COLWISE = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "c_attn", "c_fc", "fc1", "w1", "w3")
COMMON_ROWWISE = ("o_proj", "out_proj", "down_proj", "c_proj", "fc2", "w2")


def common_tensor_parallel(*, axis: AxisName = "model") -> Rules:
    """Tensor parallelism by the projection names common model code uses (``q_proj``, ``down_proj``, ``c_fc``...).

    Examples:
        >>> len(common_tensor_parallel())  # per style a weight, a bias and peft's two LoRA factors
        8
    """
    names = lambda group: [r"(?:.*\.)?(?:" + "|".join(group) + ")"]  # noqa: E731
    return tensor_parallel(colwise=names(COMMON_COLWISE), rowwise=names(COMMON_ROWWISE), axis=axis)
