"""The benchmarks write their tables into docs/benchmarks.md between two markers named after the
script (`<!-- benchmarks/<script>:begin -->` ... `:end -->`), so no figure there is typed by hand."""

from __future__ import annotations

from pathlib import Path


def markers(script: str) -> tuple[str, str]:
    return f"<!-- benchmarks/{script}:begin -->", f"<!-- benchmarks/{script}:end -->"


def write_doc_block(doc: Path, table: str, script: str) -> None:
    """Replaces what stands between `script`'s markers in `doc` with `table`."""
    begin, end = markers(script)
    text = doc.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise SystemExit(f"{doc}: add the markers {begin} and {end} where the table goes")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    doc.write_text(f"{head}{begin}\n{table}\n{end}{tail}", encoding="utf-8")
