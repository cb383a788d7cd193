"""The kinds of refusal reason the conformance matrix gives, and how each is checked against eager torch.

Each kind (`KINDS`) has a pattern that finds it in a refused cell's text and a check that looks for the
construct it names in the family's eager torch code path: the attention mask eager SDPA receives, the
module or op eager forward calls, the parameters it writes, the cache layers it keeps, the line eager
generate runs, the names its checkpoint holds. tests/test_refusals.py runs them on a seeded sample of
docs/conformance.json's refused cells.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import random
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from testsupport import family_runs, packed
from tools.capabilities import CAPABILITIES, PACKED_ROWS
from tools.cells import Cell, run_cell
from tools.families import has_experts, lm_loss
from tools.rows import Row

MATRIX = Path(__file__).resolve().parents[1] / "docs" / "conformance.json"
SEED = 55  # the sample is fixed: one refusal of each kind, drawn with this seed
CP = ("cp_ring", "cp_all_gather", "cp_a2a")


# ---------------------------------------------------------------- what eager torch runs


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


@contextlib.contextmanager
def _module_stack(model: nn.Module) -> Iterator[list[str]]:
    """The names of the modules whose forward is running, innermost last, while the block runs."""
    stack: list[str] = []
    names = _names(model)

    def enter(module: nn.Module, args: Any) -> None:
        stack.append(names[id(module)])

    def leave(module: nn.Module, args: Any, out: Any) -> None:  # returns None: the output stays the module's
        stack.pop()

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


@dataclasses.dataclass(frozen=True)
class Call:
    """One eager ``scaled_dot_product_attention`` call: shapes, the mask it got and the module that made it."""

    query: tuple[int, ...]
    key: tuple[int, ...]
    mask: tuple[str, tuple[int, ...]] | None
    caller: str
    values: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)


def _sdpa_calls(monkeypatch: pytest.MonkeyPatch, model: nn.Module, run: Callable[[], Any]) -> list[Call]:
    """Every SDPA call eager torch makes while ``run()`` runs ``model``."""
    calls: list[Call] = []
    original = nn.functional.scaled_dot_product_attention

    def recorded(query, key, value, attn_mask=None, *args, **kwargs):
        mask = None if attn_mask is None else (str(attn_mask.dtype).removeprefix("torch."), tuple(attn_mask.shape))
        values = None if attn_mask is None else attn_mask.detach().clone()
        calls.append(Call(tuple(query.shape), tuple(key.shape), mask, stack[-1] if stack else "", values))
        return original(query, key, value, attn_mask, *args, **kwargs)

    with _module_stack(model) as stack, monkeypatch.context() as patch:
        patch.setattr(nn.functional, "scaled_dot_product_attention", recorded)
        run()
    return calls


class _Ops(TorchFunctionMode):
    """The torch functions and Tensor methods called while a named module runs."""

    def __init__(self, stack: list[str], module: str) -> None:
        super().__init__()
        self.stack, self.module, self.seen = stack, module, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.module in self.stack:
            bool_index = func.__name__ == "__getitem__" and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in args[1:]
            )
            self.seen.append("bool_index" if bool_index else func.__name__)
        return func(*args, **(kwargs or {}))


def _ops_in(model: nn.Module, module: str, run: Callable[[], Any]) -> list[str]:
    with _module_stack(model) as stack, _Ops(stack, module) as ops:
        run()
    return ops.seen


def _packed_batch() -> tuple[torch.Tensor, ...]:
    """The first batch the packed context-parallel cells train on (tools.capabilities._packed)."""
    return packed.packed_batches(2, lengths=PACKED_ROWS)[0]


def _eager_step(model: nn.Module, column: str) -> Callable[[], Any]:
    """The eager forward of the cell's loss: packed rows for the context-parallel columns, else the LM loss."""
    if column in CP:
        return lambda: packed.packed_loss(model, _packed_batch())
    return lambda: lm_loss(model, family_runs.batches()[0])


def _called_module(model: nn.Module, name: str, run: Callable[[], Any]) -> bool:
    called = []
    handle = model.get_submodule(name).register_forward_hook(lambda *a: called.append(1))
    try:
        run()
    finally:
        handle.remove()
    return bool(called)


def _lines_run(path: str, run: Callable[[], Any]) -> set[int]:
    """The line numbers of ``path`` (a file's path ending) that run while ``run()`` runs."""
    lines: set[int] = set()

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.endswith(path):
            return None
        if event == "line":
            lines.add(frame.f_lineno)
        return tracer

    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
    return lines


# ---------------------------------------------------------------- each kind of reason, checked against eager torch


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of refusal reason: the pattern that finds it (older wordings too) and the eager check of its
    construct, given the row, the column and the reason's match in the current text."""

    pattern: str
    check: Callable[..., None]
    columns: tuple[str, ...] = ()  # the columns whose refusals of this kind are sampled (all when empty)


def check_mask(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    dtype, shape = found["dtype"], tuple(int(n) for n in found["shape"].split(","))
    model = row.fresh()
    calls = _sdpa_calls(monkeypatch, model, _eager_step(model, column))
    assert any(c.mask == (dtype, shape) for c in calls), f"eager SDPA never gets a {dtype}{list(shape)} mask: {calls}"
    if found["caller"]:
        assert any(c.caller == found["caller"] and c.mask for c in calls), (found["caller"], calls)
    text = found.string
    if "position_ids (packed documents)" in text:  # the mask follows the documents: unpacked rows change it
        unpacked = (*_packed_batch()[:2], torch.arange(64).expand(4, 64))
        plain = _sdpa_calls(monkeypatch, model, lambda: packed.packed_loss(model, unpacked))
        same = [a.values is not None and b.values is not None and torch.equal(a.values, b.values)
                for a, b in zip(plain, calls, strict=True)]  # fmt: skip
        assert not all(same), "eager SDPA gets the same masks for packed and unpacked rows"
    if (window := re.search(r"sliding window or chunks of (\d+) tokens", text)) is not None:
        config = model.config
        spans = {getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)}
        assert int(window[1]) in spans, (window[1], spans)


def _check_lengths(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model = row.fresh()
    calls = _sdpa_calls(monkeypatch, model, _eager_step(model, column))
    lengths = (int(found["q"]), int(found["k"]))
    hits = [c for c in calls if (c.query[2], c.key[2]) == lengths]
    assert hits, f"no eager SDPA call over {lengths[0]} queries and {lengths[1]} keys: {calls}"
    if found["caller"]:
        assert any(c.caller == found["caller"] for c in hits), (found["caller"], hits)


def _check_indexer(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model = row.fresh()
    assert _called_module(model, found["module"], _eager_step(model, column)), f"{found['module']} is not called"


_VALUE_OPS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"}
_SHAPE_OPS = {"torch.nonzero": {"nonzero", "where", "argwhere"}, "indexing with a boolean mask": {"bool_index"},
              "torch.masked_select": {"masked_select"}, "torch.unique": {"unique"},
              "repeat_interleave": {"repeat_interleave"}}  # fmt: skip


def _check_traced(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model = row.fresh()
    ops = set(_ops_in(model, found["module"], _eager_step(model, column)))
    if found["op"] is None:
        assert ops & _VALUE_OPS, f"{found['module']} asks no tensor for a Python value in eager torch: {sorted(ops)}"
        return
    wanted = next(names for call, names in _SHAPE_OPS.items() if found["op"].startswith(call))
    assert ops & wanted, f"{found['module']} calls none of {wanted} in eager torch: {sorted(ops)}"


def _check_inplace(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model = row.fresh()
    params = dict(model.named_parameters())
    names = [n.strip() for n in found["params"].split(",")]
    before = {n: params[n]._version for n in names}
    with torch.no_grad():
        _eager_step(model, column)()
    assert all(params[n]._version > before[n] for n in names), "eager forward writes none of them in place"


def _check_cache_state(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.no_grad():
        out = row.original(input_ids=family_runs.batches()[0][:1, :8], use_cache=True)
    layers = [type(layer).__name__ for layer in out.past_key_values.layers]
    # eager transformers keeps the dynamic twin of each static layer the reason names
    named = {n.strip().replace("Static", "Dynamic") for n in found["layer"].split(",")}
    for index in (int(i) for i in found["layers"].split(",")):
        assert layers[index] in named, (index, layers)


def _check_no_static_cache(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import StaticCache

    with pytest.raises(Exception) as raised:
        StaticCache(config=row.original.config, max_cache_len=1)
    assert type(raised.value).__name__ == found["error"] and found["message"] in str(raised.value)


def _check_no_past(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    parameters = inspect.signature(row.original.forward).parameters
    assert not {"past_key_values", "cache"} & set(parameters), list(parameters)
    if found["state"]:
        assert found["state"] in parameters, list(parameters)


def check_untraceable(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids = row.original, family_runs.batches()[0][:2, :5]
    generate = functools.partial(model.generate, ids, max_new_tokens=3, do_sample=False)
    assert _called_module(model, found["module"], generate), f"eager generate does not call {found['module']}"
    assert int(found["line"]) in _lines_run(found["path"], generate), f"eager generate never runs {found['path']}"


def _check_heads_split(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    value = getattr(row.original.config.get_text_config(decoder=True), found["field"])
    assert value == int(found["value"]) and value % int(found["size"]), (found["field"], value)


def _check_no_tp_plan(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(row.original).__name__ == found["model"]
    assert not getattr(row.original.config, "base_model_tp_plan", None)
    assert not getattr(row.original, "tp_plan", None)


def _saved_names(row: Row) -> set[str]:
    saved: set[str] = set()
    for file in row.checkpoint.glob("*.safetensors"):
        with safe_open(file, "pt") as opened:
            saved |= set(opened.keys())
    return saved


def _check_checkpoint_names(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _saved_names(row)
    assert found["name"] in row.original.state_dict() and found["name"] not in saved, sorted(saved)[:8]


def _check_converted_names(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _saved_names(row)
    assert found["source"] in saved and found["name"] not in saved, sorted(saved)[:8]
    assert found["name"] in row.original.state_dict()


def _check_meta_buffer(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    name = found["name"]
    assert name in dict(row.original.named_buffers()) and name not in row.original.state_dict()


def _check_no_experts(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    config = row.original.config
    plans = {**(getattr(config, "base_model_ep_plan", None) or {}), **(config.base_model_tp_plan or {})}
    assert not {"grouped_gemm", "moe_tp_experts"} & set(plans.values()), plans
    stacked = [n for n, p in row.original.named_parameters() if p.ndim == 3]
    if found["stacked"]:
        assert found["stacked"] in stacked, stacked
    else:
        assert not has_experts(row.original), stacked


def _check_no_match(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    pattern = found["pattern"].replace("\\\\", "\\")
    matched = [n for n in row.original.state_dict() if re.fullmatch(pattern, n)]
    assert not matched, matched


def _check_not_identical(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    stack = row.fresh().get_submodule(found["stack"])
    first, other = stack[0], stack[int(found["index"])]
    if found["type"]:
        assert [type(other).__name__, type(first).__name__] == [found["type"], found["type0"]]
        return
    if found["setting"]:  # a setting of a submodule: its value in both blocks, as the reason quotes them
        where, _, key = found["setting"].rpartition(".")
        values = [repr(getattr(b.get_submodule(where), key, None)) for b in (other, first)]
        assert values == [found["value"], found["first"]], values
        return
    layout = [[(n, type(m).__name__, tuple(p.shape)) for n, m in b.named_modules() for p in m.parameters(False)]
              + [(n, type(m).__name__, ()) for n, m in b.named_modules()] for b in (first, other)]  # fmt: skip
    assert layout[0] != layout[1], f"{found['stack']}.{found['index']} has block 0's submodules and parameters"


def _block_calls(model: nn.Module, name: str, run: Callable[[], Any]) -> list[tuple[tuple[Any, ...], Any]]:
    """(positional and keyword arguments, output) of each eager call of the module ``name``."""
    calls: list[tuple[tuple[Any, ...], Any]] = []

    def hook(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        calls.append(((*args, *kwargs.values()), out))

    handle = model.get_submodule(name).register_forward_hook(hook, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return calls


def _check_block_outputs(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model = row.fresh()
    outs = [out for _, out in _block_calls(model, found["block"], _eager_step(model, column))]
    counts = {len([t for t in (o if isinstance(o, tuple) else (o,)) if isinstance(t, torch.Tensor)]) for o in outs}
    assert counts == {int(found["count"])}, counts


def _check_folded_rows(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model = row.fresh()
    shape = tuple(int(n) for n in found["shape"].split(","))
    assert shape[0] == int(found["rows"]) * int(found["times"]), shape
    calls = _block_calls(model, f"{found['stack']}.0", _eager_step(model, column))
    got = [tuple(a.shape) for args, _ in calls for a in args if isinstance(a, torch.Tensor)]
    assert shape in got, f"eager {found['stack']}.0 gets no {list(shape)} argument: {got}"


def _check_several_stacks(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model = row.fresh()
    stacks = re.findall(r"'([\w.]+)'", found["stacks"])
    for name in stacks:
        blocks = model.get_submodule(name)
        assert isinstance(blocks, nn.ModuleList) and len({type(b) for b in blocks}) == 1, name
    assert len(stacks) > 1 and all(_called_module(model, f"{n}.0", _eager_step(model, column)) for n in stacks)


def _check_call_order(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model = row.fresh()
    stack, _, _ = found["module"].rpartition(".")
    order: list[int] = []
    handles = [
        b.register_forward_hook(lambda *a, i=i: order.append(i)) for i, b in enumerate(model.get_submodule(stack))
    ]
    try:
        _eager_step(model, column)()
    finally:
        for handle in handles:
            handle.remove()
    assert order != sorted(set(order)), f"eager runs {stack}'s blocks once each, in order: {order}"


def _check_gqa_flag(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    model = row.fresh()
    calls = _sdpa_calls(monkeypatch, model, _eager_step(model, "train"))
    heads = (int(found["q"]), int(found["kv"]))
    assert any((c.query[1], c.key[1]) == heads for c in calls), (heads, calls)


def _check_indivisible(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    shape = tuple(int(n) for n in found["shape"].split(","))
    assert tuple(row.original.state_dict()[found["name"]].shape) == shape


def _check_too_few_layers(row: Row, column: str, found: re.Match, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(row.fresh().get_submodule(found["stack"])) == int(found["count"])


_CALLER = r"(?:called by (?P<caller>[\w.]+) )?"
_MODULE = r"\w+ '(?P<module>[\w.]+)'"
_NO_PAST = (
    r"its forward takes no past_key_values(?: \((?:it carries a recurrent state of its own(?: \((?P<state>\w+)=\))?"
    r"|it keeps no KV cache)\))?"
)
KINDS = {
    "cp_mask": Kind(
        _CALLER + r"under Context.*attn_mask (?P<dtype>\w+)\[(?P<shape>[\d, ]+)\] is (?:traced|computed from the "
        r"step's inputs)",
        check_mask,
    ),
    "cp_lengths": Kind(
        _CALLER + r"under Context.*queries \((?P<q>\d+)\) and keys \((?P<k>\d+)\) differ", _check_lengths
    ),
    "cp_indexer": Kind(r"has sparse-attention indexers \((?P<module>[\w.]+), \d+ in all\)", _check_indexer),
    "traced": Kind(
        rf"loss_fn: {_MODULE} (?:uses (?P<op>.+?), a data-dependent shape|turns a traced tensor into a Python value)",
        _check_traced,
        ("train", "evaluate", *CP),  # LoRA's cells name the module inside peft's wrappers
    ),
    "in_place": Kind(r"forward writes parameter\(s\) (?P<params>[\w., ]+?) in place", _check_inplace),
    "cache_state": Kind(
        r"keeps (?P<layer>[\w, ]+?) state in its cache \(layers \[(?P<layers>[\d, ]+)\]\)", _check_cache_state
    ),
    "no_static_cache": Kind(
        r"cannot lay out a static KV cache for its config \((?P<error>\w+): (?P<message>[^)]*)\)",
        _check_no_static_cache,
    ),
    "no_past_key_values": Kind(_NO_PAST, _check_no_past),
    "untraceable": Kind(
        rf"generate cannot trace the decoding of \w+: {_MODULE} .*?, at (?P<path>[\w/.-]+):(?P<line>\d+)"
        r"|it is not a causal LM generate can decode",  # its wording before issue 55
        check_untraceable,
    ),
    "heads_split": Kind(
        r"config\.(?P<field>\w+)=(?P<value>\d+) is not divisible by the '\w+' axis size (?P<size>\d+)",
        _check_heads_split,
    ),
    "no_tp_plan": Kind(r"(?P<model>\w+) has no tensor-parallel plan", _check_no_tp_plan),
    "checkpoint_names": Kind(
        r"missing (?P<name>[\w.]+) \([\d, ]*\): in the model, not in the checkpoint", _check_checkpoint_names
    ),
    "converted_names": Kind(
        r"- (?P<name>[\w.]+) \(from (?P<source>[\w.]+)\): transformers converts it", _check_converted_names
    ),
    "meta_buffer": Kind(
        r"- (?P<name>[\w.]+) \([\d, ]*\): on the meta device and not in the checkpoint", _check_meta_buffer
    ),
    "no_stacked_experts": Kind(
        r"has no stacked expert weights in its ep_plan or tp_plan(?:.*?it has 3-D weights \((?P<stacked>[\w.]+))?",
        _check_no_experts,
    ),
    "not_identical": Kind(
        r"(?P<stack>[\w.]+?)\.(?P<index>\d+) (?:is a (?P<type>\w+), block 0 a (?P<type0>\w+)|differs from block 0: "
        r"its (?:submodules differ|parameters or buffers differ|setting (?P<setting>[\w.]+) is (?P<value>.+?), "
        r"block 0's is (?P<first>[^;)]+)))",
        _check_not_identical,
    ),
    "block_outputs": Kind(
        r"scan_layers: (?P<block>[\w.]+) returned (?P<count>\d+) tensor\(s\); a scanned block may return only",
        _check_block_outputs,
    ),
    "folded_rows": Kind(
        r"Pipeline: (?P<stack>[\w.]+): a layer failed .* gave \w+ \((?P<dtype>\w+)\[(?P<shape>[\d, ]+)\], "
        r"(?P<rows>\d+) rows × (?P<times>\d+)\) whole",
        _check_folded_rows,
    ),
    "several_stacks": Kind(r"has several stacks of identical layers \[(?P<stacks>[^\]]+)\]", _check_several_stacks),
    "call_order": Kind(r"scan_layers: (?P<module>[\w.]+) was called when block \d+ was next", _check_call_order),
    "gqa_flag": Kind(r"(?P<q>\d+) query heads and (?P<kv>\d+) key/value heads need enable_gqa=True", _check_gqa_flag),
    "indivisible_dim": Kind(
        r"- (?P<name>[\w.]+) \((?P<shape>[\d, ]+)\) spec .*? is not divisible by", _check_indivisible
    ),
    "too_few_layers": Kind(r"(?P<stack>[\w.]+) has (?P<count>\d+) (?:block\(s\)|layers)", _check_too_few_layers),
    "pattern_matches_nothing": Kind(r"pattern '(?P<pattern>.+?)' matches no tensor of the model", _check_no_match),
}
# refusals whose stated reason names no construct, each with why (not torchshard's to fix)
NAMES_NO_CONSTRUCT = {
    "tracing and lowering the training step ...": "tools/capabilities.py plan_compile takes the first line plan "
    "--compile writes to stderr, its progress line, for the error",
}


def kind_of(text: str) -> str | None:
    return next((name for name, kind in KINDS.items() if re.search(kind.pattern, text, re.DOTALL)), None)


def refusals() -> list[tuple[str, str, str]]:
    """(model type, column, reason) of every refused cell of docs/conformance.json."""
    families = json.loads(MATRIX.read_text())["families"]
    return [
        (model_type, column, cell["text"])
        for model_type, row in sorted(families.items())
        for column, cell in sorted((row.get("cells") or {}).items())
        if cell["status"] == "refused"
    ]


def sample() -> list[tuple[str, str, str, str]]:
    """One refusal of each kind, drawn with `SEED` from the columns it is sampled in (and tools.capabilities runs):
    (kind, model type, column, reason)."""
    rng, picked = random.Random(SEED), []
    for name, kind in KINDS.items():
        found = [r for r in refusals() if kind_of(r[2]) == name and r[1] in (kind.columns or CAPABILITIES)]
        if found:
            picked.append((name, *rng.choice(found)))
    return picked


def same(text: str) -> str:
    """The reason with what differs between runs of one build taken out (temporary folders)."""
    return re.sub(r"/tmp/\S+", "TMP", text)


def rerun(model_type: str, column: str, folder: Path) -> tuple[Row, Cell]:
    """The cell as the matrix runs it: its row's eager eval-mode logits first (RWKV rescales its weights then)."""
    row = Row(model_type, folder)
    assert row.eager_outputs["logits"].ndim == 3
    return row, run_cell(CAPABILITIES[column], row)
