"""The benchmarks write their tables into the docs (docs/benchmarks.md, README.md) between two
markers named after the script and an optional block name (`<!-- benchmarks/<script>:begin<block>
-->` ... `<!-- benchmarks/<script>:end<block> -->`), from a results JSON under
benchmarks/results/, so no figure there is typed by hand. A table is rendered
from the stored JSON alone (no GPU, nothing measured), and a field the table needs but the file
lacks stops the render with one line naming the file and the field."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def markers(script: str, block: str = "") -> tuple[str, str]:
    return f"<!-- benchmarks/{script}:begin{block} -->", f"<!-- benchmarks/{script}:end{block} -->"


def write_doc_block(doc: Path, table: str, script: str, block: str = "") -> None:
    """Replaces what stands between the markers of `script`'s `block` in `doc` with `table`; an
    indented begin marker (a block inside a Markdown list item) keeps its end marker indented."""
    begin, end = markers(script, block)
    replace_between(doc, begin, end, table)


def replace_between(doc: Path, begin: str, end: str, table: str) -> None:
    """Replaces what stands between the lines `begin` and `end` in `doc` with `table`."""
    text = doc.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise SystemExit(f"{doc}: add the markers {begin} and {end} where the table goes")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    indent = head[head.rfind("\n") + 1:]
    indent = indent if not indent.strip() else ""
    doc.write_text(f"{head}{begin}\n{table}\n{indent}{end}{tail}", encoding="utf-8")


def read_results(path: Path) -> dict[str, Any]:
    """A results JSON a benchmark wrote; one line naming the file where it is missing or not
    JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such results file") from None
    except json.JSONDecodeError as error:
        raise SystemExit(f"{path}: not a results JSON ({error})") from None


def render_results(path: Path, render: Callable[[dict[str, Any]], Any]) -> Any:
    """`render` applied to the results in `path`; a field it needs and the file lacks stops
    with one line naming the file and the field (an older file, or one another script wrote)."""
    results = read_results(path)
    with fields_of(str(path), render.__name__):
        return render(results)


@contextmanager
def fields_of(source: str, table: str) -> Iterator[None]:
    """Turns a KeyError raised while `table` reads the results of `source` (a file or several)
    into one line naming them and the missing field."""
    try:
        yield
    except KeyError as missing:
        raise SystemExit(f"{source}: no field {missing.args[0]!r}, which {table} needs; rerun "
                         "the benchmark that writes this file") from None
