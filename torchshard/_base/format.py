"""Text formatting shared by plan tables, pictures, reports and the CLI."""

from __future__ import annotations

from collections.abc import Sequence


def fmt_bytes(n: float) -> str:
    """A byte count in binary units.

    Examples:
        >>> fmt_bytes(512), fmt_bytes(3 * 2**20)
        ('512 B', '3.00 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def fmt_shape(shape: Sequence[int]) -> str:
    """``8×4``, or ``()`` for a scalar."""
    return "×".join(map(str, shape)) or "()"


def columns(rows: Sequence[Sequence[str]], *, indent: str = "") -> list[str]:
    """Rows of cells as left-aligned text columns, two spaces apart.

    Examples:
        >>> print("\\n".join(columns([("name", "bytes"), ("fc.weight", "1 KiB")])))
        name       bytes
        fc.weight  1 KiB
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def table(head: Sequence[str], body: Sequence[Sequence[str]], foot: str) -> str:
    """A text table: header, a dashed rule, the rows, then a footer line."""
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return "\n".join([*columns([head, tuple("-" * w for w in widths), *body]), foot])
