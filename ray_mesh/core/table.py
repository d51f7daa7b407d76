"""The one plain-text table every ray_mesh printout uses (Ray-free; imports only ``safe``).

The layout table rank 0 prints, ``ray-mesh status``, ``ray-mesh plan``'s node list and
``ray-mesh doctor``'s connectivity matrix are all columns of short cells: one helper keeps
them aligned the same way (left-justified, two spaces apart, a dashed rule under the
header, no trailing blanks), so a reader and a test can split any of them on whitespace.
Cells often hold what a node reported (its IP, interface, hostname): every cell is printed
escaped (:func:`~ray_mesh.core.safe.safe_text`), so a cell is one line and sends
the terminal no control sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ray_mesh.core.safe import safe_text


def format_cell(value: Any) -> str:
    """A cell's text: floats without noise (``1234``, ``0.5``, ``3.142``, ``nan``), else
    ``str``, escaped."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.0f}" if abs(value) >= 1000 or value == int(value) else f"{value:.4g}"
    return safe_text(value)


def text_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *,
               indent: str = "", rule: bool = True) -> str:
    """``rows`` (column -> value; a missing key is an empty cell) as aligned text.

    The header is ``columns`` itself; ``rule`` puts a dashed line under it; ``indent``
    starts every line (for tables nested under a heading).
    """
    cells = [[format_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return (indent + "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True))
                ).rstrip()

    lines = [line(list(columns))]
    if rule:
        lines.append(indent + "  ".join("-" * w for w in widths))
    lines += [line(row) for row in cells]
    return "\n".join(lines)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """The same rows as a Markdown table (for the layout file a person opens after a run)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(format_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
