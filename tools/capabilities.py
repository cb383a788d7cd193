"""One row of the conformance matrix: each torchshard capability on one transformers family, against eager torch.

The references, batches and tolerances are the test suite's (testsupport/: helpers, family_runs, evaluation,
generation, packed, precision, peft_lora, bf16_gradients); this module runs them on any family and turns each
outcome into a `Cell` (tools/cells.py) instead of an assertion.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import json
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optax
import torch

import torchshard as ts
from testsupport import bf16_gradients, evaluation, family_runs, generation, packed, peft_lora, precision
from testsupport.helpers import jit_forward, scaled_error, torch_losses
from tools.cells import (
    NOISE_RATIO,
    Cell,
    Work,
    eager,
    first_line,
    losses_cell,
    noisy_losses_cell,
    run_cell,
    within,
)
from tools.combos import COMBOS
from tools.families import build, lm_loss
from tools.rows import NOT_MOE, Row, forward, state_error, step_losses

# packed rows of 64 tokens (the families' positions): documents crossing the 16-token chunks of context=4
PACKED_ROWS = [[20, 30, 14], [64], [10, 40, 14], [16, 16, 16, 16]]
FP32_GRADIENTS = 1e-5  # relative L2 of all gradients: fp32 runs differ by summation order only (2e-7 to 1e-6 seen)
SHORT, LONG = 5, 12  # prompt lengths: shorter and longer than the families' windows (tools.tiny.FIXED: 8)


@dataclasses.dataclass(frozen=True)
class Column:
    """A capability: its key, its heading and how its cell is judged."""

    key: str
    title: str
    truth: str


COLUMNS = (
    Column("train", "train hf_rules", "4 AdamW steps on data=4 × model=2 (FSDP × TP; FSDP alone where the family "
           "has no tp_plan, noted); losses rtol "
           f"{family_runs.RTOL:.0e}"),
    Column("evaluate", "evaluate", f"Trainer.evaluate after training vs eager on its weights: loss rtol "
           f"{evaluation.RTOL:.0e}, logits max|Δ|/max(1,max|eager|) ≤ {evaluation.RTOL:.0e}"),
    Column("load_meta", "load → meta", "load_safetensors into a meta-built model + hf_rules plan: state bit-equal, "
           f"forward logits ≤ {evaluation.RTOL:.0e} (scaled as above)"),
    Column("load_trainer", "load → Trainer", "load_safetensors into the trained Trainer: state bit-equal, "
           f"evaluate logits ≤ {evaluation.RTOL:.0e}"),
    Column("generate", f"generate ({SHORT})", f"greedy, {generation.NEW} new tokens, prompts of {SHORT} (under "
           "the window), plain and left-padded: every token equal to eager HF generate"),
    Column("generate_long", f"generate ({LONG})", f"as generate, prompts of {LONG} (past the 8-token windows)"),
    Column("cp_ring", "packed CP ring", "packed documents, data=2 × context=4, 2 AdamW steps vs eager transformers "
           f"on the same position ids; losses rtol {family_runs.RTOL:.0e}"),
    Column("cp_all_gather", "packed CP all_gather", "as packed CP ring, attention='all_gather'"),
    Column("a2a", "MoE all_to_all", "data=2 × expert=4, ExpertDispatch('all_to_all'); losses rtol "
           f"{family_runs.RTOL:.0e}"),
    Column("bf16", "MoE bf16 all_to_all", "MixedPrecision on expert=4 × model=2 (all-to-all) vs an eager torch twin "
           f"of the bf16 policy; losses rtol {precision.RTOL:.0e} (over it, — when within {NOISE_RATIO:.0f}× the "
           "spread of eager torch's own runs on other kernels); one step's gradients: fp32 within "
           f"{FP32_GRADIENTS:.0e} of eager's, bf16's drift from fp32 0.5–{bf16_gradients.RATIO}× eager's, top-k "
           "routing pinned to eager fp32's"),
    Column("cp_a2a", "MoE CP × all_to_all", "packed documents, context=2 × expert=4, ring; losses rtol "
           f"{family_runs.RTOL:.0e}"),
    Column("lora", "LoRA TP", "peft LoRA on the tp_plan's Linear layers, data=4 × model=2; losses rtol "
           f"{family_runs.RTOL:.0e}"),
    Column("plan_compile", "plan --compile", "python -m torchshard plan --preset hf --compile --batch 8x16 on "
           "data=4 × model=2: compiles; peak bytes per device"),
    *(Column(key, title, truth) for key, (title, truth, _) in COMBOS.items()),
)  # fmt: skip


# ---------------------------------------------------------------- the capabilities


def train(row: Row, work: Work) -> Cell:
    data = family_runs.batches()
    expected = row.eager_losses
    # a family without a tp_plan (hf_rules refuses it: plan --compile's cell says so) trains on FSDP alone, noted:
    # training is checked on every family, as a user of such a model would run it
    got = step_losses(row.trainer, data, work)
    cell = losses_cell(got, expected, family_runs.RTOL)
    known = row.family.mismatch
    return row.noted(Cell(cell.status, f"{cell.text} (known: {known})") if known and cell.status == "fail" else cell)


def evaluate(row: Row, work: Work) -> Cell:
    out = row.trainer.evaluate(row.batch, forward)
    work.began = True
    reference = row.fresh().eval()
    reference.load_state_dict(ts.to_torch_state_dict(row.trainer))
    with torch.no_grad():
        expected = eager(forward, reference, row.batch)
    loss = abs(float(out["loss"]) - float(expected["loss"])) / abs(float(expected["loss"]))
    if loss > evaluation.RTOL:
        return Cell("fail", f"loss differs by {loss:.1e} (rtol {evaluation.RTOL})")
    return row.noted(within(scaled_error(out["logits"], expected["logits"]), evaluation.RTOL, "logits"))


def _loaded_cell(state: dict[str, torch.Tensor], row: Row, logits: Callable[[], Any]) -> Cell:
    """Bit-equal state, then the forward's logits — unless torchshard refuses that forward (the evaluate column)."""
    error = state_error(state, row.original.state_dict())
    if error:
        return Cell("fail", f"loaded state differs from the checkpoint by {error:.1e}")
    if row.forward_refusal:  # the load is right; the forward is refused up front, as evaluate's cell says
        return Cell("ok", f"state bit-equal; forward refused as in evaluate ({row.forward_refusal[:60]}...)")
    return row.noted(within(scaled_error(logits(), row.eager_outputs["logits"]), evaluation.RTOL, "logits"))


def load_meta(row: Row, work: Work) -> Cell:
    checkpoint = row.checkpoint
    with torch.device("meta"):
        model = build(row.family)
    axes, rules, _ = family_runs.rules(row.plan_kind, model)
    mesh = ts.make_mesh(axes)
    ts.load_safetensors(checkpoint, model, ts.plan(model, mesh, rules))
    work.began = True
    logits_of = jit_forward(model.eval(), output="logits", use_cache=False)  # the eager logits are eval mode's
    return _loaded_cell(ts.to_torch_state_dict(model), row, lambda: logits_of(ts.shard_batch(row.batch, mesh)))


def load_trainer(row: Row, work: Work) -> Cell:
    ts.load_safetensors(row.checkpoint, row.trainer)
    work.began = True
    logits = lambda: row.trainer.evaluate(row.batch, forward)["logits"]  # noqa: E731
    return _loaded_cell(ts.to_torch_state_dict(row.trainer), row, logits)


def _generate(row: Row, work: Work, seq: int) -> Cell:
    """Greedy tokens against transformers' generate; where its cache disagrees with its own forward (moshi's sliding
    cache under a full causal mask), against its generate without a cache: the model's forward is the truth."""
    ids = generation.prompts(seq=seq)
    mask = generation.left_padded(ids)
    differ, uncached = [], []
    for name, kwargs in (("plain", {}), ("left-padded", {"attention_mask": mask})):
        expected = eager(generation.eager_generate, row.original, ids, eos_token_id=None, **kwargs)
        got = ts.generate(row.placed, ids, max_new_tokens=generation.NEW, eos_token_id=[], **kwargs)
        work.began = True
        new = expected[:, seq:].numel()
        wrong = _wrong(got, expected, seq)
        if wrong and not _wrong(got, eager(generation.eager_generate, row.original, ids, use_cache=False,
                                           eos_token_id=None, **kwargs), seq):  # fmt: skip
            uncached.append(f"{wrong}/{new} tokens of transformers' cached generate differ from its uncached ({name})")
        elif wrong:
            differ.append(f"{wrong}/{new} tokens differ ({name})")
    if differ:
        return row.noted(Cell("fail", "; ".join(differ)))
    return row.noted(Cell("ok", "= eager" + (f" without cache ({'; '.join(uncached)})" if uncached else "")))


def _wrong(got: torch.Tensor, expected: torch.Tensor, seq: int) -> int:
    """How many new tokens differ (all of them if the shapes do)."""
    return int((got[:, seq:] != expected[:, seq:]).sum()) if got.shape == expected.shape else expected[:, seq:].numel()


def generate(row: Row, work: Work) -> Cell:
    return _generate(row, work, SHORT)


def generate_long(row: Row, work: Work) -> Cell:
    return _generate(row, work, LONG)


def _packed(row: Row, work: Work, axes: dict[str, int], rules: Any, batch_spec: Any, **kwargs: Any) -> Cell:
    data = packed.packed_batches(2, lengths=PACKED_ROWS)
    expected = eager(packed.eager_losses, row.fresh(), data)
    model = row.fresh()
    plan = ts.plan(model, ts.make_mesh(axes), rules(model) if rules else None)
    trainer = ts.Trainer(model, packed.packed_loss, packed.adamw(), plan, batch_spec=batch_spec, **kwargs)
    got = step_losses(trainer, data, work)
    return losses_cell(got, expected, family_runs.RTOL)


def cp_ring(row: Row, work: Work) -> Cell:
    context = ts.ContextParallel(attention="ring")
    return _packed(row, work, {"data": 2, "context": 4}, None, ("data", "context"), context=context)


def cp_all_gather(row: Row, work: Work) -> Cell:
    context = ts.ContextParallel(attention="all_gather")
    return _packed(row, work, {"data": 2, "context": 4}, None, ("data", "context"), context=context)


def a2a(row: Row, work: Work) -> Cell:
    if not row.moe:
        return NOT_MOE
    data = family_runs.batches()
    expected = row.eager_losses
    trainer = family_runs.trainer_for(row.fresh(), "expert_parallel")
    got = step_losses(trainer, data, work)
    cell = losses_cell(got, expected, family_runs.RTOL)
    moved = trainer.strategies["expert_dispatch"].option == ts.ExpertDispatch("all_to_all")
    return (
        cell if moved else Cell(cell.status, f"{cell.text} (dispatch: {trainer.strategies['expert_dispatch'].option})")
    )


def bf16(row: Row, work: Work) -> Cell:
    if not row.moe:
        return NOT_MOE
    data = family_runs.batches()
    expected = eager(precision.torch_mixed_precision, row.fresh(), lm_loss, data)
    trainer = family_runs.trainer_for(row.fresh(), "expert_model", precision=ts.MixedPrecision())
    got = step_losses(trainer, data, work)
    losses = noisy_losses_cell(got, list(expected), precision.RTOL, lambda: _reordered(row, data))
    if losses.status != "ok":
        return losses
    grads = bf16_gradient_cell(row.fresh(), data[0])
    return Cell(grads.status, f"losses {losses.text}; {grads.text}")


def bf16_gradient_cell(model: torch.nn.Module, ids: torch.Tensor) -> Cell:
    """One step's gradients: torchshard's fp32 must be eager's, and its bf16 must drift from its fp32 as eager
    torch's bf16 drifts from eager's fp32 (ratio in (0.5, 1.25]: a step that ran in fp32 scores ~0, a 3× drift
    fails), with the routers' top-k pinned to eager fp32's choice where they can be (tests/test_bf16_moe.py:
    two bf16 runs round apart as far as either is from fp32, so no tolerance between them can tell bf16 from
    fp32; and a token whose k-th and next expert tie within bf16 rounding flips by chance, moving a tiny
    model's gradients ~1 % per token)."""
    pinned = bool(bf16_gradients.routers(model))
    with bf16_gradients.pinned_routing(model, ids) if pinned else contextlib.nullcontext():
        d = eager(bf16_gradients.gradient_distances, model, ids)
    if d["fp32"] > FP32_GRADIENTS:
        return Cell("fail", f"fp32 gradients differ from eager's by {d['fp32']:.1e} (tol {FP32_GRADIENTS:.0e})")
    ratio = d["torchshard"] / d["eager"]
    text = f"grads drift {ratio:.2f}× eager's from fp32 ({d['torchshard']:.1e})"
    if not pinned:  # a chance flip may double either side: only a step that did not run in bf16 is caught
        ok, text = ratio > 0.5, f"{text}, routing not pinned"
    else:
        ok, text = 0.5 < ratio <= bf16_gradients.RATIO, f"{text}, routing pinned"
    return Cell("ok" if ok else "fail", text if ok else f"{text} (want 0.5 < ratio ≤ {bf16_gradients.RATIO})")


def _reordered(row: Row, data: list[torch.Tensor]) -> list[list[float]]:
    """Eager torch's bf16 losses summed in other orders: another experts kernel, oneDNN off (torch's own
    matmuls), and both; each a correct run of the same policy, together a measure of its noise."""
    runs = []
    for kernel, onednn in ((True, True), (False, False), (True, False)):
        with contextlib.suppress(Exception), torch.backends.mkldnn.flags(enabled=onednn):  # unrunnable: no measure
            model = _other_kernel(row.fresh()) if kernel else row.fresh()
            runs.append(list(precision.torch_mixed_precision(model, lm_loss, data)))
    return runs


def _other_kernel(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` on another of transformers' experts kernels (one that sums in another order than its default)."""
    default = getattr(model.config, "_experts_implementation", None)
    model.set_experts_implementation("grouped_mm" if default == "batched_mm" else "batched_mm")
    return model


def cp_a2a(row: Row, work: Work) -> Cell:
    if not row.moe:
        return NOT_MOE
    rules = functools.partial(ts.presets.hf_rules, axis=None, expert_axis="expert", fsdp_axis=None)
    return _packed(row, work, {"context": 2, "expert": 4}, rules, ("expert", "context"), context=ts.ContextParallel())


def lora_targets(model: torch.nn.Module) -> list[str]:
    """The names of the Linear layers the model's tp_plan splits column- or row-wise (peft's target_modules)."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    names = {key.rsplit(".", 1)[-1] for key, style in plan.items() if "colwise" in style or "rowwise" in style}
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names & linear)


def lora(row: Row, work: Work) -> Cell:
    targets = lora_targets(row.original)
    if not targets:
        return Cell("n/a", "no Linear layer in the tp_plan")
    torch.manual_seed(0)  # peft's initialisation of the adapters
    model = peft_lora.lora(row.fresh(), targets)
    ref = copy.deepcopy(model)
    data = family_runs.batches()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=peft_lora.LR, weight_decay=peft_lora.WD)
    expected = eager(torch_losses, ref, peft_lora.lm_loss, optimizer, data)
    axes, rules = peft_lora.RULES["fsdp_tp"]
    plan = ts.plan(model, ts.make_mesh(axes), rules(model))
    trainer = ts.Trainer(model, peft_lora.lm_loss, optax.adamw(peft_lora.LR, weight_decay=peft_lora.WD), plan)
    got = step_losses(trainer, data, work)
    return losses_cell(got, expected, family_runs.RTOL)


def plan_compile(row: Row, work: Work) -> Cell:
    from torchshard.__main__ import EXIT_INVALID_PLAN, main

    argv = ["plan", f"tools.families:FACTORIES.{row.family.model_type}", "--mesh", "data=4,model=2", "--preset",
            "hf", "--compile", "--batch", "8x16", "--format", "json"]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    # the error's lines, not the progress the command prints on the way ("tracing and lowering ...")
    progress = ("note:", "error: invalid", "tracing", "compiling", "lowering", "building")
    lines = [x for x in err.getvalue().splitlines() if x.strip() and not x.strip().startswith(progress)]
    if code == EXIT_INVALID_PLAN:
        return Cell("refused", f"ShardingError: {' '.join(line.strip() for line in lines)}"[:300])  # with its problems
    if code:
        return Cell("fail", f"exit {code}: {lines[-1] if lines else ''}"[:300])
    compiled = json.loads(out.getvalue())["compiled"]
    return Cell("ok", f"peak {compiled['peak_bytes'] / 2**20:.2f} MiB")


CAPABILITIES: dict[str, Callable[[Row, Work], Cell]] = {
    "train": train,
    "evaluate": evaluate,
    "load_meta": load_meta,
    "load_trainer": load_trainer,
    "generate": generate,
    "generate_long": generate_long,
    "cp_ring": cp_ring,
    "cp_all_gather": cp_all_gather,
    "a2a": a2a,
    "bf16": bf16,
    "cp_a2a": cp_a2a,
    "lora": lora,
    "plan_compile": plan_compile,
    **{key: capability for key, (_, _, capability) in COMBOS.items()},
}
assert list(CAPABILITIES) == [c.key for c in COLUMNS]


def skip_reason(model_type: str) -> str | None:
    """Why a family has no row of results (not a text causal LM, or no tiny build), or None."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    config_class = getattr(transformers, configuration_auto.CONFIG_MAPPING_NAMES.get(model_type, ""), None)
    lm_class = getattr(transformers, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    if config_class is None or lm_class is None:
        return "transformers names no config or causal-LM class for it"
    sub = [k for k in ("text_config", "vision_config", "audio_config") if k in getattr(config_class, "sub_configs", {})]
    if sub:
        return f"not a text-only causal LM (its config nests {', '.join(sub)})"
    return None


def _row(model_type: str, folder: Path) -> tuple[Row | None, str]:
    """The family's `Row`, or why it has none: its tiny model does not build, or eager torch cannot run it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on tiny configs
        try:
            row = Row(model_type, folder)
            logits = row.eager_outputs["logits"]
            changed = row.batch.clone()
            changed[:, -1] = (changed[:, -1] + 1) % 128
            with torch.no_grad():
                later = forward(row.original, changed)["logits"][:, :-1]
            # an encoder moves earlier logits by O(1); a MoE whose expert kernel groups a batch's tokens moves them by
            # float noise (dots3_note_text: 3e-8) that depends on the thread count, and is causal all the same
            sees_later = (later - logits[:, :-1]).abs().max() > 1e-4 * max(1.0, float(logits.abs().max()))
        except Exception as err:  # no truth to compare with
            return None, f"cannot build or run eagerly from a tiny config: {type(err).__name__}: {first_line(err)}"
    if sees_later:
        return None, "not causal: its eager logits change with later tokens (an encoder; is_decoder=False)"
    return row, ""


def run_family(
    model_type: str, keys: list[str] | None = None, *, starting: Callable[[str], None] = lambda key: None
) -> Iterator[tuple[str, Cell]]:
    """("kind", dense or MoE), then each capability's cell on ``model_type`` in `COLUMNS` order (``keys`` limits them).

    Yields ("skipped", reason) alone when the family has no row: not a text causal LM, no tiny
    build, or eager torch cannot run it (there is then no truth to compare with). ``starting(key)``
    is called as each capability starts (a process that dies in it can then say where).
    """
    reason = skip_reason(model_type)
    with tempfile.TemporaryDirectory() as folder:
        row, reason = (None, reason) if reason else _row(model_type, Path(folder))
        if row is None:
            yield "skipped", Cell("n/a", reason)
            return
        yield "kind", Cell("n/a", "MoE" if row.moe else "dense")
        for key in keys or list(CAPABILITIES):
            starting(key)
            yield key, run_cell(CAPABILITIES[key], row)
