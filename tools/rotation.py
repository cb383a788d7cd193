"""Which rows of the conformance matrix a CI run rechecks: a slice that rotates with the commit, plus fixed rows.

The whole matrix takes about two CPU-hours; CI has well under one. Each run rechecks every N-th family
(interleaved, so each slice mixes dense and MoE rows) starting at an offset the commit picks, and always
the representative families: N commits in a row recheck every row. Before those it rechecks the families a
change names: those whose model type a line added or removed since the committed table's commit mentions
(a fix for one family names it in its code, its test or its tiny config).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path


def parse_slice(text: str, commit: str | None = None) -> tuple[int, int]:
    """``"K/N"`` → (K, N), slice K of N (0 ≤ K < N); ``"commit/N"``: K from ``commit`` (default: git's HEAD).

    Raises:
        ValueError: not two integers with 0 ≤ K < N.

    Examples:
        >>> parse_slice("1/3"), parse_slice("commit/3", commit="9feb995") == (commit_slice("9feb995", 3), 3)
        ((1, 3), True)
    """
    k, _, n = text.partition("/")
    parts = int(n)
    if k == "commit":
        head = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        k = str(commit_slice(head, parts))
    part = int(k)
    if not 0 <= part < parts:
        raise ValueError(f"--slice {text!r}: K/N with 0 <= K < N, e.g. 0/3")
    return part, parts


def commit_slice(commit: str, parts: int) -> int:
    """The slice a commit rechecks: its hash, reduced mod ``parts`` (any string works; the same string, the same slice).

    Examples:
        >>> commit_slice("9feb995", 3) == commit_slice("9feb995", 3)
        True
    """
    return int(hashlib.sha256(commit.encode()).hexdigest(), 16) % parts


def sliced(names: Sequence[str], part: int, parts: int) -> list[str]:
    """Every ``parts``-th of ``names`` (sorted) from ``part``.

    Examples:
        >>> sliced(["a", "b", "c", "d", "e"], 1, 2)
        ['b', 'd']
    """
    return sorted(names)[part::parts]


def named(names: Sequence[str], diff: str) -> list[str]:
    """The ``names`` that a changed line of ``diff`` (unified format) mentions as a whole word, any case.

    Examples:
        >>> diff = "--- a/x.py\\n+++ b/x.py\\n+# Apertus' XIELU keeps its beta\\n-hf_llama = 1\\n qwen2 stays"
        >>> named(["apertus", "llama", "qwen2"], diff)
        ['apertus']
    """
    changed = "\n".join(line[1:] for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))
    return [n for n in names if re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", changed, re.IGNORECASE)]


def touched(names: Sequence[str], since: str, repo: Path | None = None) -> list[str]:
    """The ``names`` that the change from commit ``since`` to the working tree of ``repo`` mentions (``named``).

    The committed table's own files are left out: regenerating it names every family. An unknown commit (a
    shallow clone, a rewritten history) names none; the slice and the representative rows still run.
    """
    tables = [":!docs/conformance.md", ":!docs/conformance.json"]
    command = ["git", "diff", since, "--", ".", *tables]
    diff = subprocess.run(command, capture_output=True, text=True, cwd=repo or Path(__file__).parents[1])
    return named(names, diff.stdout) if diff.returncode == 0 else []
