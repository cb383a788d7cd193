"""Ready-made rule tables: replicated, data parallel, FSDP and tensor parallel."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence

import torch
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from torchshard._rules import Rule, Rules, SpecTransform, TensorInfo
from torchshard._specs import entry_axes, spec_axes
from torchshard._validate import describe_mesh, int_problems, raise_for_arguments

AxisName = str | tuple[str, ...]


def replicated() -> Rules:
    """Every tensor replicated on every device.

    Example:
        >>> replicated().spec_for("anything")
        P()
    """
    return Rules([(r".*", PartitionSpec())], source="replicated")


def data_parallel() -> Rules:
    """Data parallelism: parameters replicated, only the batch is sharded (by the Trainer).

    Example:
        >>> data_parallel().spec_for("fc.weight")
        P()
    """
    return Rules([(r".*", PartitionSpec())], source="data_parallel")


def axis_problems(what: str, axis: AxisName, mesh: Mesh | AbstractMesh) -> list[str]:
    """A preset's axis names that ``mesh`` lacks."""
    where = describe_mesh(mesh)
    return [f"{what} axis {a!r} is not an axis of {where}; use one of {list(mesh.shape)}" for a in entry_axes(axis)
            if a not in mesh.shape]  # fmt: skip


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

    Example:
        >>> rules = tensor_parallel(colwise=["fc1"], rowwise=["fc2"]) + fsdp("data")
        >>> rules.transforms[0].label
        "+fsdp('data')"
    """
    raise_for_arguments(int_problems("min_size", min_size, minimum=0), header="invalid fsdp() arguments")
    return Rules(transforms=(FSDP(axis, min_size),))


def is_embedding(module_type: type | None) -> bool:
    """``torch.nn.Embedding`` or a subclass (e.g. Gemma's scaled word embedding)."""
    return module_type is not None and issubclass(module_type, torch.nn.Embedding)


def is_conv1d(module_type: type | None) -> bool:
    """transformers' ``Conv1D`` (GPT-2) or a subclass, recognised without importing transformers."""
    # a module of that class exists only once transformers is imported, so planning never imports it
    owner = sys.modules.get("transformers.pytorch_utils")
    return module_type is not None and owner is not None and issubclass(module_type, owner.Conv1D)


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
        if self.param == "bias":
            return PartitionSpec(self.axis) if self.style == "colwise" else PartitionSpec()
        # torch Linear is [out, in]; Conv1D is [in, out]; Embedding is [num, dim], so colwise
        # splits its dim and rowwise its vocabulary
        transposed = is_conv1d(info.module_type) or is_embedding(info.module_type)
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        dim = out_dim if self.style == "colwise" else in_dim
        # a module with a 1-d weight (e.g. LayerNorm) yields a spec longer than its rank, which plan reports
        entries: list[AxisName | None] = [None] * max(len(info.shape), dim + 1)
        entries[dim] = self.axis
        return PartitionSpec(*entries)


def tensor_parallel(colwise: Sequence[str] = (), rowwise: Sequence[str] = (), *, axis: AxisName = "model") -> Rules:
    """Megatron-style tensor parallelism; patterns name *modules* (``Linear``/``Embedding``).

    ``colwise`` Linear: weight ``[out, in]`` → ``(axis, None)``, bias → ``(axis,)``.
    ``rowwise`` Linear: weight → ``(None, axis)``, bias replicated. ``Embedding`` (``[num, dim]``):
    colwise shards ``dim``, rowwise shards the vocabulary. Subclasses count as their base.

    Args:
        colwise: regexes of module names whose outputs are split over ``axis``.
        rowwise: regexes of module names whose inputs are split over ``axis``.
        axis: the tensor-parallel mesh axis.

    Example:
        >>> rules = tensor_parallel(colwise=[r"layers\\.\\d+\\.up"], rowwise=[r"layers\\.\\d+\\.down"])
        >>> [rule.pattern for rule in rules][:2]
        ['(?:layers\\\\.\\\\d+\\\\.up)\\\\.weight', '(?:layers\\\\.\\\\d+\\\\.up)\\\\.bias']
    """
    rows = []
    for style, patterns in (("colwise", colwise), ("rowwise", rowwise)):
        if isinstance(patterns, str):
            patterns = [patterns]
        for pattern in patterns:
            Rules([(pattern, ())])  # validates the regex with a clear error
            head = f"(?:{pattern})"
            rows.append(Rule(head + r"\.weight", Layout(style, axis, "weight"), f"tp:{style}"))
            rows.append(Rule(head + r"\.bias", Layout(style, axis, "bias"), f"tp:{style}", warn_unused=False))
    return Rules(rows)


# Module names that Megatron-style TP splits by output (colwise) or by input (rowwise) in common model code.
COMMON_COLWISE = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "c_attn", "c_fc", "fc1", "w1", "w3")
COMMON_ROWWISE = ("o_proj", "out_proj", "down_proj", "c_proj", "fc2", "w2")


def common_tensor_parallel(*, axis: AxisName = "model") -> Rules:
    """Tensor parallelism by the projection names common model code uses (``q_proj``, ``down_proj``, ``c_fc``...).

    Example:
        >>> len(common_tensor_parallel())  # a weight and a bias rule per style
        4
    """
    names = lambda group: [r"(?:.*\.)?(?:" + "|".join(group) + ")"]  # noqa: E731
    return tensor_parallel(colwise=names(COMMON_COLWISE), rowwise=names(COMMON_ROWWISE), axis=axis)
