"""Every report the project writes for people (data report, eval report, model card, Prefect
artifacts) shows tables in Markdown, so one function renders them: a cell holding a pipe, a
newline or a model's `<SOLUTION>` tag must look the same wherever it appears."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["flatten", "markdown_cell", "markdown_table"]


def markdown_cell(value: Any) -> str:
    """A value as one cell: floats to 4 significant digits, None as '–', long lists counted,
    HTML escaped (tags stay visible), pipes escaped, newlines as <br>."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return f"{len(value)} items" if len(value) > 8 else ", ".join(map(markdown_cell, value))
    text = html.escape(str(value), quote=False).replace("|", "\\|")
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: Sequence[str] | None = None) -> str:
    """A Markdown table; `align` holds one of 'left', 'right' per column (default: left)."""
    rules = {"left": "---", "right": "---:"}
    align = align or ["left"] * len(header)
    if len(align) != len(header):
        raise ValueError(f"{len(align)} alignments for {len(header)} columns")
    lines = ["| " + " | ".join(map(markdown_cell, header)) + " |",
             "| " + " | ".join(rules[a] for a in align) + " |"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(header)} columns")
        lines.append("| " + " | ".join(map(markdown_cell, row)) + " |")
    return "\n".join(lines)


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted key -> value (params for a table row or a fingerprint)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
