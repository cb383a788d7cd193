"""Every refusal names the construct that blocks it: the conformance matrix's refusals checked against eager code.

A seeded sample of docs/conformance.json's refused cells, one of each kind of reason, is re-run
(`tools.capabilities`) and must be refused for the same reason; then the construct the reason names
is looked for in the family's eager torch code path: the attention mask eager SDPA receives, the module
or op eager forward calls, the parameters it writes, the cache layers it keeps, the line eager generate
runs, the names its checkpoint holds. The kinds of reason (`KINDS`) were found by grouping the
matrix's refusal texts; a refusal of no known kind fails `test_every_refusal_is_of_a_known_kind`.
Also here: the refusals issue 55 found untrue, made to work (BioGPT's float all-ones mask under
packed context parallelism) or said truly (XGLM's generate, packed rows under a sliding window).
"""

from __future__ import annotations

import copy
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import torchshard as ts
from testsupport import packed
from testsupport.helpers import torch_losses
from testsupport.refusal_kinds import (
    KINDS,
    NAMES_NO_CONSTRUCT,
    check_mask,
    check_untraceable,
    kind_of,
    refusals,
    rerun,
    same,
    sample,
)
from tools.families import build, family
from tools.rows import Row

pytest.importorskip("transformers")

SLOW = pytest.mark.slow


# ---------------------------------------------------------------- the tests


def test_every_refusal_is_of_a_known_kind():
    unknown = [r for r in refusals() if kind_of(r[2]) is None and not any(t in r[2] for t in NAMES_NO_CONSTRUCT)]
    assert unknown == [], "a new kind of refusal reason: add its check to KINDS"


@SLOW
@pytest.mark.filterwarnings("ignore")  # the families' own warnings on their tiny configs
@pytest.mark.parametrize(("kind", "model_type", "column", "reason"), sample(), ids=lambda v: str(v)[:20])
def test_a_refusal_names_a_construct_eager_torch_runs(kind, model_type, column, reason, monkeypatch):
    """The sampled refusal, re-run: its construct is in eager torch's code path (whatever the reason says now), and
    the reason is docs/conformance.json's; a cell the current code treats otherwise is skipped, saying how."""
    stale = "docs/conformance.json predates the change: regenerate it (python3 dev.py conformance)"
    with tempfile.TemporaryDirectory() as folder:
        row, cell = rerun(model_type, column, Path(folder))
        if cell.status != "refused":
            pytest.skip(f"{model_type} {column} is no longer refused (now {cell.render()[:160]}); {stale}")
        now = kind_of(cell.text)
        if now is not None:
            KINDS[now].check(row, column, re.search(KINDS[now].pattern, cell.text, re.DOTALL), monkeypatch)
    if now != kind or same(cell.text) != same(reason):
        checked = f"its construct ({now}) is checked, but " if now else "a reason of no known kind: "
        pytest.skip(f"{model_type} {column} is refused otherwise now: {checked}docs/conformance.json says "
                    f"{reason[:200]!r}, now {cell.text[:200]!r}; {stale}")  # fmt: skip


@SLOW
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("column", ["cp_ring", "cp_all_gather"])
def test_biogpt_float_all_ones_mask_trains_under_packed_context_parallelism(column):
    """BioGPT builds ``torch.ones(batch, seq)`` (float) when the call passes no attention_mask; computed while
    tracing, transformers sees no padding and passes is_causal=True, as in eager torch (losses rtol 1e-4)."""
    with tempfile.TemporaryDirectory() as folder:
        _, cell = rerun("biogpt", column, Path(folder))
    assert cell.status == "ok", cell.render()


class _OnesMasked(nn.Module):
    """One attention layer over a mask made of ``torch.ones(B, S)`` (float), as BioGPT's, and causal ``tril``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = torch.ones(ids.shape[0], ids.shape[1]).bool()  # padding: none
        s = ids.shape[1]
        mask = keep[:, None, None, :] & torch.ones(s, s, dtype=torch.bool).tril()
        h = self.embed(ids)
        q = h.view(*h.shape[:2], 4, 8).transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return self.head(y.transpose(1, 2).reshape(h.shape))


def _ones_masked_trainer(model: nn.Module) -> ts.Trainer:
    mesh = ts.make_mesh({"data": 2, "context": 4})
    return ts.Trainer(model, _ones_masked_loss, packed.adamw(), ts.plan(model, mesh),
                      batch_spec=("data", "context"), context=ts.ContextParallel())  # fmt: skip


def _ones_masked_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]).reshape(-1, 64), batch[1].reshape(-1))


def _ones_masked_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = [torch.randint(0, 64, (4, 65), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return [(x[:, :-1], x[:, 1:]) for x in ids]


@SLOW
def test_a_float_all_ones_mask_is_computed_while_tracing():
    torch.manual_seed(0)
    ref = _OnesMasked()
    trainer = _ones_masked_trainer(copy.deepcopy(ref))
    got = [float(trainer.step(b)["loss"]) for b in _ones_masked_batches()]
    opt = torch.optim.AdamW(ref.parameters(), lr=packed.LR, betas=packed.BETAS, eps=packed.EPS,
                            weight_decay=packed.WEIGHT_DECAY)  # fmt: skip
    np.testing.assert_allclose(got, torch_losses(ref, _ones_masked_loss, opt, _ones_masked_batches()), rtol=1e-4)


def test_a_float_fill_over_the_limit_stays_traced_and_is_refused_as_traced(monkeypatch):
    from torchshard._bridge import constants

    monkeypatch.setattr(constants, "FILL_LIMIT", 255)  # the [4, 64] ones: 256 values
    trainer = _ones_masked_trainer(_OnesMasked())
    traced = r"attn_mask bool\[4, 1, 64, 64\] is traced, computed in the step from the batch or the model's tensors"
    with pytest.raises(ts.ShardingError, match=traced):
        trainer.step(_ones_masked_batches()[0])


@pytest.mark.filterwarnings("ignore")
def test_packed_rows_under_a_sliding_window_are_refused_for_that(monkeypatch):
    """Mistral's packed rows were refused for "a padding attention_mask in the batch" the batch did not have."""
    with tempfile.TemporaryDirectory() as folder:
        row, cell = rerun("mistral", "cp_ring", Path(folder))
        assert cell.status == "refused"
        assert re.search(
            r"called by model.layers.0.self_attn .*attn_mask bool\[4, 1, 64, 64\] is traced: transformers built it "
            r"from the batch's position_ids \(packed documents\) and a sliding window or chunks of 8 tokens",
            cell.text,
        ), cell.text
        check_mask(row, "cp_ring", re.search(KINDS["cp_mask"].pattern, cell.text, re.DOTALL), monkeypatch)


@pytest.mark.filterwarnings("ignore")
def test_the_mask_check_finds_biogpt_s_former_reason_untrue(monkeypatch):
    """The matrix refused BioGPT's packed cells for an attention mask; eager SDPA gets none there."""
    former = (  # docs/conformance.json's before issue 55
        "ShardingError: scaled_dot_product_attention(query [4, 4, 64, 16], key [4, 4, 64, 16]) under "
        "ContextParallel(axis='context', attention='ring', load_balance=True) on Mesh(data=2, context=4) (1 problem): "
        "- attn_mask bool[4, 1, 64, 64] is computed from the step's inputs (e.g. a padding attention_mask in the batch)"
    )
    with tempfile.TemporaryDirectory() as folder:
        row = Row("biogpt", Path(folder))
        with pytest.raises(AssertionError, match=r"eager SDPA never gets a bool\[4, 1, 64, 64\] mask"):
            check_mask(row, "cp_ring", re.search(KINDS["cp_mask"].pattern, former, re.DOTALL), monkeypatch)


def _placed(model_type: str) -> nn.Module:
    model = build(family(model_type)).eval()
    return ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))


@pytest.mark.filterwarnings("ignore")
def test_generate_names_what_a_causal_lm_runs_that_it_cannot_trace():
    """XGLM was refused as "not a causal LM": its sinusoidal positions branch on the KV cache's traced length."""
    xglm = (
        r"generate cannot trace the decoding of XGLMForCausalLM: XGLMSinusoidalPositionalEmbedding "
        r"'model.embed_positions' needs a traced tensor's value in Python .*, at transformers/models/xglm/"
        r"modeling_xglm.py:\d+ \(`if .*max_pos > self.weights.size\(0\):`\), which raised ConcretizationTypeError"
    )
    with tempfile.TemporaryDirectory() as folder:
        row = Row("xglm", Path(folder))
        with pytest.raises(ts.ArgumentError, match=xglm) as raised:
            ts.generate(row.placed, torch.tensor([[5, 6, 7]]), max_new_tokens=2)
        found = re.search(KINDS["untraceable"].pattern, str(raised.value))
        check_untraceable(row, "generate", found, monkeypatch=None)  # eager generate runs that line


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    ("model_type", "match"),
    [("openai-gpt", r"takes no past_key_values \(it keeps no KV cache\)"),
     ("rwkv", r"takes no past_key_values \(it carries a recurrent state of its own \(state=\)\)")],
)  # fmt: skip
def test_generate_says_what_a_model_without_past_key_values_keeps(model_type, match):
    with pytest.raises(ts.ArgumentError, match=match):
        ts.generate(_placed(model_type), torch.tensor([[5, 6, 7]]), max_new_tokens=2)
