"""The one Markdown table renderer: escaping and alignment that every report relies on."""

from __future__ import annotations

import pytest

from vlmrl.reporting.tables import markdown_cell, markdown_table


def test_cells_escape_what_would_break_a_table() -> None:
    assert markdown_cell("a|b\nc") == "a\\|b<br>c"
    assert markdown_cell("<SOLUTION>4</SOLUTION>") == "&lt;SOLUTION&gt;4&lt;/SOLUTION&gt;"
    assert markdown_cell(None) == "–"
    assert markdown_cell(0.123456) == "0.1235"
    assert markdown_cell([1, 2]) == "1, 2"
    assert markdown_cell(list(range(9))) == "9 items"


def test_table_has_header_rule_and_rows() -> None:
    table = markdown_table(["metric", "value"], [["accuracy", 0.5]], ["left", "right"])
    assert table.splitlines() == ["| metric | value |", "| --- | ---: |", "| accuracy | 0.5 |"]


def test_ragged_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="has 1 cells for 2 columns"):
        markdown_table(["a", "b"], [["x"]])
