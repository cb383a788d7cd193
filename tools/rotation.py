"""Which rows of the conformance matrix a CI run rechecks: a slice that rotates with the commit, plus fixed rows.

The whole matrix takes about two CPU-hours; CI has well under one. Each run rechecks every N-th family
(interleaved, so each slice mixes dense and MoE rows) starting at an offset the commit picks, and always
the representative families: N commits in a row recheck every row.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Sequence


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


def sliced(names: Sequence[str], part: int, parts: int, always: Sequence[str] = ()) -> list[str]:
    """Every ``parts``-th of ``names`` (sorted) from ``part``, then those of ``always`` not among them.

    Examples:
        >>> sliced(["a", "b", "c", "d", "e"], 1, 2, always=["a"])
        ['b', 'd', 'a']
    """
    chosen = sorted(names)[part::parts]
    return chosen + [n for n in always if n in names and n not in chosen]
