"""How one capability's outcome becomes a cell of the conformance matrix: ✓, refused, ✗ or —."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import torchshard as ts

TYPED = (ts.ShardingError, ts.ArgumentError, ts.CheckpointError)
# torchshard's own folder: a venv's site-packages may lie under one called torchshard too (dev.py compat's)
OURS = str(Path(ts.__file__).parent)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One capability on one family: ``status`` is ok, refused, fail or n/a; ``text`` the difference or reason."""

    status: str
    text: str
    seconds: float = 0.0

    def render(self) -> str:
        prefix = {"ok": "✓ ", "refused": "refused: ", "fail": "✗ ", "n/a": "— "}[self.status]
        return (prefix + self.text).strip()


class Work:
    """Set once a capability has produced a result: a typed error after that is a failure, not a refusal."""

    began = False


def first_line(err: BaseException) -> str:
    """The error's first line (with its first problem when that line only introduces a list), cut to 400 chars."""
    lines = [x.strip() for x in str(err).strip().splitlines()] or [type(err).__name__]
    return (f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0])[:400]


def _noted(caught: list[warnings.WarningMessage]) -> str:
    """torchshard's own warnings (not UnusedRuleWarning: plans name modules a config leaves out), once each."""
    ours = [w for w in caught if w.category.__module__.startswith("torchshard") or w.filename.startswith(OURS)]
    texts = dict.fromkeys(str(w.message).splitlines()[0][:160] for w in ours if w.category is not ts.UnusedRuleWarning)
    return "".join(f" (warned: {t})" for t in texts)


class NoTruth(Exception):
    """The eager reference itself failed: there is nothing to compare torchshard with."""


def eager(reference: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``reference(*args, **kwargs)``: the eager-torch truth of a cell; its failure is a `NoTruth`."""
    try:
        return reference(*args, **kwargs)
    except Exception as err:
        raise NoTruth(f"{type(err).__name__}: {first_line(err)}") from err


def run_cell(capability: Callable[[Any, Work], Cell], row: Any) -> Cell:
    """``capability(row, work)`` as a cell: a typed error before any result is a refusal, any other error a ✗."""
    work, begun = Work(), time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cell = capability(row, work)
        except TYPED as err:
            late = "typed error after work began: " if work.began else ""
            cell = Cell("fail" if late else "refused", f"{late}{type(err).__name__}: {first_line(err)}")
        except NoTruth as err:  # nothing to judge torchshard by: not a torchshard failure, and not a pass
            cell = Cell("n/a", f"no truth: eager torch fails ({err})")
        except Exception as err:  # anything else is a failure, named by its type
            cell = Cell("fail", f"{type(err).__name__}: {first_line(err)}")
    return Cell(cell.status, cell.text + _noted(caught), round(time.perf_counter() - begun, 1))


def _relative(got: list[float], expected: list[float]) -> float:
    return float(np.max(np.abs(np.subtract(got, expected)) / np.abs(expected)))


def losses_cell(got: list[float], expected: list[float], rtol: float) -> Cell:
    """✓ with the largest relative loss difference when every loss is within ``rtol`` of eager's."""
    rel = _relative(got, expected)
    ok = bool(np.isfinite(got).all()) and rel <= rtol
    return Cell("ok", f"{rel:.1e}") if ok else Cell("fail", f"losses differ by {rel:.1e} (rtol {rtol})")


# How many times eager torch's own spread a difference over the tolerance may be and still be no verdict: on 12 MoE
# families, torchshard's bf16 losses were 0.4-3.1 times that spread from eager's (docs/conformance.md, "bf16").
NOISE_RATIO = 4.0


def noisy_losses_cell(
    got: list[float], expected: list[float], rtol: float, others: Callable[[], list[list[float]]]
) -> Cell:
    """`losses_cell`, where a difference over ``rtol`` is judged against eager torch's own spread.

    ``others()`` runs eager torch's same policy again, summing in other orders (other kernels); it runs only
    when the losses are over ``rtol``. In bf16 a router's near-tie flips with the order of a sum, and AdamW makes
    a full step of any small gradient whose sign flipped, so two correct runs may differ by more than the
    tolerance: when torchshard's difference is within `NOISE_RATIO` times eager's own largest, no verdict can
    be had at that tolerance (—); beyond it, the cell stays a failure.

        >>> noisy_losses_cell([1.0, 2.004], [1.0, 2.0], 1e-3, lambda: [[1.0, 2.0016], [1.0, 2.0]]).render()
        '— no truth at rtol 0.001: losses differ by 2.0e-03, eager from itself by 8.0e-04 (other kernels)'
        >>> noisy_losses_cell([1.0, 2.004], [1.0, 2.0], 1e-3, lambda: [[1.0, 2.0002]]).render()
        '✗ losses differ by 2.0e-03 (rtol 0.001); eager from itself by 1.0e-04 (other kernels)'
    """
    cell = losses_cell(got, expected, rtol)
    if cell.status == "ok":
        return cell
    rel, spread = _relative(got, expected), max((_relative(other, expected) for other in others()), default=0.0)
    spread_text = f"eager from itself by {spread:.1e} (other kernels)"
    if bool(np.isfinite(got).all()) and rel <= NOISE_RATIO * spread:
        return Cell("n/a", f"no truth at rtol {rtol}: losses differ by {rel:.1e}, {spread_text}")
    return Cell("fail", f"{cell.text}; {spread_text}")


def within(error: float, tol: float, what: str) -> Cell:
    return Cell("ok", f"{error:.1e}") if error <= tol else Cell("fail", f"{what} differ by {error:.1e} (tol {tol})")
