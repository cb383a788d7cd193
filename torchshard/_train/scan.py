"""Scan over layers: a ModuleList (or ModuleDict) of identical blocks runs as one ``lax.scan`` over stacked weights."""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import jax
import torch

from torchshard._base.errors import ShardingError
from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.env import continue_from, current_key
from torchshard._bridge.module_call import PureForward, split
from torchshard._bridge.module_tensors import model_tensors, tie_groups
from torchshard._bridge.tensors import is_jax_tensor, wrap

ScanLike = bool | str | Sequence[str]
# per-layer attributes that may differ between otherwise identical blocks (a KV-cache slot index)
_INDEX_ATTRS = re.compile(r"(?i).*(layer_idx|layer_id|layer_index|layer_number|block_idx|idx)$")
_SIMPLE = (bool, int, float, str, type(None))


class ScanLayersWarning(UserWarning):
    """``scan_layers=True`` left a ModuleList unscanned (the warning says why)."""


class StackRunner(Protocol):
    """How a strategy runs a scanned stack it took over (a pipeline's stages): the strategies' execution hook.

    A strategy's `Bound.rewrite` puts one on the `ScanGroup` it takes; the step then runs that stack
    with ``run`` instead of one ``lax.scan``, and the train state stores it in ``order()``, its dim 0
    split over ``axis`` (None: not split).
    """

    @property
    def axis(self) -> str | None: ...

    def order(self) -> tuple[int, ...]: ...

    def run(self, scan: ScanRun, pure: PureForward, h: jax.Array, others: Sequence[jax.Array]) -> tuple[Any, Any]:
        """(the stack's output hidden state, the key the model continues with); may set ``scan.new_buffers``."""
        ...


@dataclasses.dataclass(frozen=True)
class ScanGroup:
    """One scanned ModuleList or ModuleDict: its name, its number of blocks, and each block's tensor names."""

    prefix: str
    count: int
    suffixes: tuple[str, ...]  # tensor names relative to a block, canonical ones only
    buffers: frozenset[str]
    keys: tuple[str, ...] = ()  # a ModuleDict's keys in order ("0".."N-1" in torchtitan); a ModuleList's indices
    # a stack a strategy runs its own way (a pipeline's stages), stored in its order with dim 0 over its axis
    runner: StackRunner | None = None

    def block(self, index: int) -> str:
        """The torch name of block ``index``, e.g. ``model.layers.3``."""
        return f"{self.prefix}.{self.keys[index] if self.keys else index}"

    def index(self, key: str) -> int | None:
        """The position of the block named ``prefix.key`` (None if there is none)."""
        keys = self.keys or tuple(str(i) for i in range(self.count))
        return keys.index(key) if key in keys else None

    def name(self, index: int, suffix: str) -> str:
        """The torch name of one block's tensor, e.g. ``model.layers.3.mlp.up.weight``."""
        return f"{self.block(index)}.{suffix}"

    def stacked(self, suffix: str) -> str:
        """The train-state key of a tensor stacked over the blocks, e.g. ``model.layers.*.mlp.up.weight``."""
        return f"{self.prefix}.*.{suffix}"

    def positions(self) -> tuple[int, ...]:
        """The block at each position of the stack (in order, unless a pipeline stores it stage by stage)."""
        return self.runner.order() if self.runner is not None else tuple(range(self.count))

    @property
    def axis(self) -> str | None:
        """The mesh axis the stack's dim 0 is split over (a pipeline's stages), or None."""
        return self.runner.axis if self.runner is not None else None

    def members(self) -> Iterator[tuple[str, list[str]]]:
        """(stacked key, the per-block names in stack order) for every tensor of a block."""
        for suffix in self.suffixes:
            yield self.stacked(suffix), [self.name(i, suffix) for i in self.positions()]


def _simple(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


def _attributes(module: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and _simple(v) and not _INDEX_ATTRS.match(k)}


def _tensor_signature(block: torch.nn.Module) -> list[tuple[Any, ...]]:
    return [
        (t.name, t.kind, tuple(t.tensor.shape), t.tensor.dtype, t.tensor.requires_grad) for t in model_tensors(block)
    ]


def _block_difference(first: torch.nn.Module, other: torch.nn.Module) -> str | None:
    """How ``other`` differs from ``first`` in structure, tensors or settings, or None."""
    mods0, mods = dict(first.named_modules()), dict(other.named_modules())
    if [(n, type(m)) for n, m in mods0.items()] != [(n, type(m)) for n, m in mods.items()]:
        return "its submodules differ"
    if _tensor_signature(first) != _tensor_signature(other):
        return "its parameters or buffers differ (names, shapes, dtypes or requires_grad)"
    for name, module in mods.items():
        a, b = _attributes(mods0[name]), _attributes(module)
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                where = f"{name}.{key}" if name else key
                return f"its setting {where} is {b.get(key)!r}, block 0's is {a.get(key)!r}"
    return None


def _named_blocks(container: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(key, block) of a ModuleList (its indices) or a ModuleDict (its keys, in insertion order)."""
    if isinstance(container, torch.nn.ModuleDict):
        return list(container.items())
    assert isinstance(container, torch.nn.ModuleList)
    return [(str(i), block) for i, block in enumerate(container)]


def block_problems(model: torch.nn.Module, prefix: str) -> list[str]:
    """Why the ModuleList (or ModuleDict) ``prefix`` of ``model`` cannot run as a scan (empty if it can)."""
    container = model.get_submodule(prefix)
    if not isinstance(container, torch.nn.ModuleList | torch.nn.ModuleDict):
        return [f"{prefix} is a {type(container).__name__}, not a torch.nn.ModuleList or ModuleDict"]
    blocks = _named_blocks(container)
    if len(blocks) < 2:
        return [f"{prefix} has {len(blocks)} block(s); a scan needs at least 2"]
    (key0, first), problems = blocks[0], []
    for key, block in blocks:
        if type(block) is not type(first):
            problems.append(f"{prefix}.{key} is a {type(block).__name__}, block {key0} a {type(first).__name__}")
        elif (why := _block_difference(first, block)) is not None:
            problems.append(f"{prefix}.{key} differs from block {key0}: {why}")
    return problems + _tie_problems(model, prefix)


def _tie_problems(model: torch.nn.Module, prefix: str) -> list[str]:
    ties = tie_groups(model_tensors(model))
    inside = lambda n: n.startswith(prefix + ".")  # noqa: E731
    groups: dict[str, list[str]] = {}
    for name, canon in ties.items():
        groups.setdefault(canon, []).append(name)
    return [
        f"{prefix}: {' = '.join(names)} is one tensor shared between blocks or with the rest of the model; a scan "
        f"stacks each block's own tensors"
        for names in groups.values()
        if len(names) > 1 and any(map(inside, names)) and not all(_same_block(prefix, n, names[0]) for n in names)
    ]


def _same_block(prefix: str, a: str, b: str) -> bool:
    head = re.compile(re.escape(prefix) + r"\.([^.]+)\.")
    ma, mb = head.match(a), head.match(b)
    return ma is not None and mb is not None and ma.group(1) == mb.group(1)


def is_stack(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a stack of layers: a ModuleList, or a ModuleDict of one kind of module."""
    # a ModuleDict counts when all its values are of one kind (torchtitan's layers); one of assorted
    # modules is not a stack of layers, and scan_layers=True passes it by without a warning
    if isinstance(module, torch.nn.ModuleDict):
        return len(module) > 1 and len({type(m) for m in module.values()}) == 1
    return isinstance(module, torch.nn.ModuleList)


def module_lists(model: torch.nn.Module) -> list[str]:
    """The model's outermost ModuleLists and stack-like ModuleDicts (the candidates for a scan)."""
    found = [n for n, m in model.named_modules() if is_stack(m) and n]
    return [n for n in found if not any(n.startswith(outer + ".") for outer in found if outer != n)]


def _group(model: torch.nn.Module, prefix: str) -> ScanGroup:
    container = model.get_submodule(prefix)
    blocks = _named_blocks(container)
    tensors = model_tensors(blocks[0][1])
    canonical = set(tie_groups(tensors).values())
    suffixes = tuple(t.name for t in tensors if t.name in canonical)
    buffers = frozenset(t.name for t in tensors if t.kind == "buffer")
    keys = tuple(k for k, _ in blocks) if isinstance(container, torch.nn.ModuleDict) else ()
    return ScanGroup(prefix, len(blocks), suffixes, buffers, keys)


def find_groups(model: torch.nn.Module, scan_layers: ScanLike) -> tuple[ScanGroup, ...]:
    """The ModuleLists to scan: every scannable one for ``True``, else the named ones.

    Raises:
        ArgumentError: ``scan_layers`` is not a bool, a name or a list of names.
        ShardingError: a named list cannot be scanned (with why), or ``True`` finds none.
    """
    if scan_layers is False:
        return ()
    if scan_layers is True:
        return _found_groups(model)
    names = [scan_layers] if isinstance(scan_layers, str) else scan_layers
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise_for_arguments(
            [f"scan_layers={scan_layers!r} must be True, False, a ModuleList / ModuleDict name or a list of names"],
            header="invalid Trainer arguments",
        )
    known = {n for n, _ in model.named_modules()}
    problems = [f"{n}: {type(model).__name__} has no module named {n!r}" for n in names if n not in known]
    problems += [p for n in names if n in known for p in block_problems(model, n)]
    if problems:
        raise ShardingError(problems, header=f"scan_layers cannot scan {names} ({len(problems)} problem(s))")
    return tuple(_group(model, n) for n in names)


def _found_groups(model: torch.nn.Module) -> tuple[ScanGroup, ...]:
    groups, reasons = [], []
    for prefix in module_lists(model):
        problems = block_problems(model, prefix)
        if problems:
            reasons.append(f"{prefix}: {problems[0]}")
            warnings.warn(f"scan_layers=True leaves {prefix} unscanned: {problems[0]}", ScanLayersWarning, stacklevel=4)
        else:
            groups.append(_group(model, prefix))
    if not groups:
        raise ShardingError(
            f"scan_layers=True found no ModuleList or ModuleDict of identical blocks in {type(model).__name__}"
            + (f" ({'; '.join(reasons)})" if reasons else "")
            + "; pass scan_layers=False"
        )
    return tuple(groups)


def blocks_of(model: torch.nn.Module, group: ScanGroup) -> list[torch.nn.Module]:
    """The blocks a group scans, in the order the model runs them."""
    return [block for _, block in _named_blocks(model.get_submodule(group.prefix))]


def _simple_leaf(value: Any) -> bool:
    return _simple(value) or isinstance(value, torch.dtype | torch.device)


@dataclasses.dataclass
class ScanRun:
    """One traced pass through a scanned ModuleList: block 0's call runs the whole scan.

    The model's own loop then calls blocks 1..N-1, each with the previous block's output and
    the same other arguments; they return the scan's result unchanged. Anything else (a block
    skipped or called twice, something done to the hidden state between blocks, different
    masks per block) cannot be a scan and raises a `ShardingError` saying so.
    """

    group: ScanGroup
    template: torch.nn.Module
    forward: Callable[..., Any]
    params: Mapping[str, jax.Array]  # suffix → stacked array
    body_policy: Callable[..., Any] | None
    hidden: Callable[[jax.Array], jax.Array] | None = None
    calls: int = 0
    result: Any = None
    inputs: tuple[Any, ...] = ()
    new_buffers: dict[str, jax.Array] = dataclasses.field(default_factory=dict)

    def hook(self, index: int) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.call(index, args, kwargs)

    def call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        where = f"scan_layers: {self.group.block(index)}"
        if index != self.calls:
            raise ShardingError(
                f"{where} was called when block {self.calls} was next; a scan runs every block once, in order "
                f"(LayerDrop and skipped or repeated layers cannot scan: set layerdrop=0 or drop scan_layers)"
            )
        if not args or not is_jax_tensor(args[0]):
            raise ShardingError(
                f"{where} got no hidden state as its first positional argument; call it as block(h, ...)"
            )
        self.calls += 1
        if index == 0:
            return self._run(args, kwargs)
        if args[0] is not self._carry_out():
            raise ShardingError(
                f"{where} got a hidden state that is not block {index - 1}'s output: the model changes it between "
                f"blocks, which a scan cannot do"
            )
        if not self._same_inputs(args[1:], kwargs):
            raise ShardingError(
                f"{where} got other arguments than block 0 (e.g. a different attention mask per layer); a scan "
                f"gives every block the same ones"
            )
        return self.result

    def _carry_out(self) -> Any:
        return self.result[0] if isinstance(self.result, tuple | list) else self.result

    def _same_inputs(self, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        leaves = jax.tree.leaves((rest, kwargs), is_leaf=lambda x: isinstance(x, torch.Tensor))
        if len(leaves) != len(self.inputs):
            return False
        return all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(leaves, self.inputs, strict=True))

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.inputs = tuple(jax.tree.leaves((args[1:], kwargs), is_leaf=lambda x: isinstance(x, torch.Tensor)))
        arrays, spec = split((args, kwargs))
        odd = [leaf for leaf in spec.statics() if not _simple_leaf(leaf) and not isinstance(leaf, torch.Tensor)]
        if odd:
            raise ShardingError(
                f"scan_layers: {self.group.block(0)} got {type(odd[0]).__name__} {odd[0]!r:.80}, an argument a scan "
                f"cannot carry through its blocks; for a KV cache, drop use_cache=True from the call (the Trainer "
                f"turns the config's use_cache off while it traces a step)"
            )
        pure = PureForward(self.template, self.forward, spec, sorted(self.group.buffers))
        if self.group.runner is not None:  # a strategy's execution hook (a pipeline's stages)
            final, key = self.group.runner.run(self, pure, arrays[0], arrays[1:])
        else:
            final, key = self.scanned(pure, arrays[0], arrays[1:])
        continue_from(key)
        self.result = pure.rebuild([final])
        return self.result

    def scanned(self, pure: PureForward, h: jax.Array, others: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Runs the blocks as one ``lax.scan`` over the stacked weights; (final hidden state, key)."""

        def body(carry: tuple[jax.Array, jax.Array], layer: Mapping[str, jax.Array]):
            # the key is carried: the blocks draw random numbers in the order a Python loop would
            h, key = carry
            h = self.hidden(h) if self.hidden is not None else h
            out, buffers, key, hooked = pure(layer, [h, *others], key)
            check_output(self.group.block(0), pure, out, h)
            return (out[0], key), (buffers, hooked)

        step = jax.checkpoint(body, policy=self.body_policy) if self.body_policy is not None else body
        (final, key), (self.new_buffers, hooked) = jax.lax.scan(step, (h, current_key()), dict(self.params))
        for i in range(self.group.count):  # each layer's hooks (MoE router logits), in the order a loop runs them
            pure.replay_hooks([stacked[i] for stacked in hooked])
        return final, key

    def finish(self) -> None:
        """Raises if the model's loop did not call every block."""
        if self.calls != self.group.count:
            raise ShardingError(
                f"scan_layers: the model called {self.calls} of the {self.group.count} blocks of "
                f"{self.group.prefix}; a scanned list must run all of them (or scan a list of the blocks used)"
            )


def check_output(first: str, pure: PureForward, out: Sequence[jax.Array], h: jax.Array) -> None:
    """Raises unless block ``first`` mapped hidden state ``h`` to one tensor of its shape and dtype."""
    assert pure.output is not None
    extra = [leaf for leaf in pure.output.statics() if leaf is not None and not _simple_leaf(leaf)]
    if len(out) != 1 or pure.output.tensor_at != (0,) or extra:
        raise ShardingError(
            f"scan_layers: {first} returned {len(out)} tensor(s); a scanned block may return only its hidden "
            f"state (first), e.g. turn output_attentions off"
        )
    if out[0].shape != h.shape or out[0].dtype != h.dtype:
        raise ShardingError(
            f"scan_layers: {first} maps a hidden state {h.dtype}{list(h.shape)} to {out[0].dtype}"
            f"{list(out[0].shape)}; a scan needs the same shape and dtype in and out (cast the input first)"
        )


def layer_slices(group: ScanGroup, stacked: Mapping[str, jax.Array]) -> dict[str, torch.Tensor]:
    """Per-block torch names → torchax tensors of their slices of the stacked arrays (for reads outside blocks)."""
    return {
        group.name(block, suffix): wrap(stacked[group.stacked(suffix)][position])
        for suffix in group.suffixes
        for position, block in enumerate(group.positions())
        if group.stacked(suffix) in stacked
    }
