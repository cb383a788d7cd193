"""Ready-made rule tables: replicated, data parallel, FSDP, tensor parallel and HF tp_plans."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from torchshard._errors import ShardingError, raise_if_any
from torchshard._mesh import describe_mesh
from torchshard._rules import Rule, Rules, SpecTransform, TensorInfo

__all__ = [
    "data_parallel",
    "from_hf_tp_plan",
    "fsdp",
    "replicated",
    "tensor_parallel",
]

AxisName = str | tuple[str, ...]


def replicated() -> Rules:
    """Every tensor replicated on every device.

    Example:
        >>> replicated().spec_for("anything")
        PartitionSpec()
    """
    return Rules([(r".*", PartitionSpec())], source="replicated")


def data_parallel() -> Rules:
    """Data parallelism: parameters replicated, only the batch is sharded (by the Trainer).

    Example:
        >>> data_parallel().spec_for("fc.weight")
        PartitionSpec()
    """
    return Rules([(r".*", PartitionSpec())], source="data_parallel")


def _axes(axis: AxisName) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _used_axes(spec: PartitionSpec) -> set[str]:
    return {a for entry in spec if entry is not None for a in _axes(entry)}


@dataclasses.dataclass(frozen=True)
class FSDP(SpecTransform):
    """Adds ``axis`` to the largest still-unsharded dim of each tensor with ≥ ``min_size`` elements."""

    axis: AxisName = "data"
    min_size: int = 2**12

    @property
    def label(self) -> str:
        return f"+fsdp({self.axis!r})"

    def __call__(self, info: TensorInfo, spec: PartitionSpec) -> PartitionSpec:
        axes = _axes(self.axis)
        if math.prod(info.shape) < self.min_size or _used_axes(spec) & set(axes):
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
        unknown = [a for a in _axes(self.axis) if a not in mesh.shape]
        where = describe_mesh(mesh)
        return [f"fsdp axis {a!r} is not an axis of {where}; use one of {list(mesh.shape)}" for a in unknown]


def fsdp(axis: AxisName = "data", min_size: int = 2**12) -> Rules:
    """Fully-sharded data parallelism: shard big tensors' largest divisible dim over ``axis``.

    Combine with other rules by addition: ``tensor_parallel(...) + fsdp()`` shards each
    tensor over the TP axis first and puts the FSDP axis on another dim.

    Args:
        axis: mesh axis (or tuple of axes) to shard over.
        min_size: tensors with fewer elements stay replicated.

    Returns:
        Rules holding only the FSDP transform (unmatched tensors start replicated).

    Example:
        >>> rules = tensor_parallel(colwise=["fc1"], rowwise=["fc2"]) + fsdp("data")
    """
    if not isinstance(min_size, int) or min_size < 0:
        raise ShardingError(f"fsdp(min_size={min_size!r}): min_size must be a non-negative int.")
    return Rules(transforms=(FSDP(axis, min_size),))


_TRANSPOSED = {"Conv1D"}  # transformers' GPT-2 Conv1D stores weight as [in, out]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shape-aware TP spec: ``colwise`` shards outputs, ``rowwise`` inputs, in the owner's layout."""

    style: str
    axis: AxisName
    param: str

    @property
    def label(self) -> str:
        return f"{self.style}({self.axis!r})"

    def __call__(self, info: TensorInfo) -> PartitionSpec:
        kind = info.module_type.__name__ if info.module_type else "?"
        if self.param == "bias":
            return PartitionSpec(self.axis) if self.style == "colwise" else PartitionSpec()
        out_dim, in_dim = (1, 0) if kind in _TRANSPOSED else (0, 1)
        if kind == "Embedding":  # [num_embeddings, dim]: colwise splits dim, rowwise the vocabulary
            out_dim, in_dim = 1, 0
        dim = out_dim if self.style == "colwise" else in_dim
        # a module with a 1-d weight (e.g. LayerNorm) yields a spec longer than its rank, which plan reports
        entries = [None] * max(len(info.shape), dim + 1)
        entries[dim] = self.axis
        return PartitionSpec(*entries)


def _module_pattern(pattern: str) -> str:
    return f"(?:{pattern})"


def tensor_parallel(colwise: Sequence[str] = (), rowwise: Sequence[str] = (), *, axis: AxisName = "model") -> Rules:
    """Megatron-style tensor parallelism; patterns name *modules* (``Linear``/``Embedding``).

    ``colwise`` Linear: weight ``[out, in]`` → ``(axis, None)``, bias → ``(axis,)``.
    ``rowwise`` Linear: weight → ``(None, axis)``, bias replicated. ``Embedding`` (``[num, dim]``):
    colwise shards ``dim``, rowwise shards the vocabulary.

    Args:
        colwise: regexes of module names whose outputs are split over ``axis``.
        rowwise: regexes of module names whose inputs are split over ``axis``.
        axis: the tensor-parallel mesh axis.

    Example:
        >>> rules = tensor_parallel(colwise=[r"layers\\.\\d+\\.up"], rowwise=[r"layers\\.\\d+\\.down"])
    """
    rows = []
    for style, patterns in (("colwise", colwise), ("rowwise", rowwise)):
        for pattern in patterns:
            Rules([(pattern, ())])  # validates the regex with a clear error
            head = _module_pattern(pattern)
            rows.append(Rule(head + r"\.weight", Layout(style, axis, "weight"), f"tp:{style}"))
            rows.append(Rule(head + r"\.bias", Layout(style, axis, "bias"), f"tp:{style}", warn_unused=False))
    return Rules(rows)


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
