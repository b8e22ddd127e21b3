"""Rows from where the data lives: a hub dataset (id, config, split, revision) through
`datasets.load_dataset`, or a local file or directory: jsonl, json, parquet, csv, or an image
folder with a metadata file as HF's imagefolder reads it (metadata.jsonl / .csv / .parquet whose
`file_name` column names each image; the row's image is then its `image` column).

A bad line of a local file never stops the read: it comes out as a `BadLine` naming the file
and line and what is wrong, and `vlmrl.data.prepare.prepare` skips it or, under `data.strict`, fails
on it. The text formats are read here line by line for that reason: `datasets`' json and csv
builders stop at the first bad line without saying which. Every good row carries its `Origin`
under the key ORIGIN: where it was read and the directory its relative image paths start from."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmrl.data.columns import ORIGIN, DataError
from vlmrl.hub import check_hub_dataset

if TYPE_CHECKING:
    from vlmrl.params import DataParams

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
METADATA_FILES = tuple(f"metadata{suffix}" for suffix in (".jsonl", ".csv", ".parquet"))


@dataclass(frozen=True)
class Origin:
    where: str  # file:line, file row N, or hub-id[split] row N
    base: Path | None = None
    source: str | None = None  # what a record without a source column is labelled: file, hub id


@dataclass(frozen=True)
class BadLine:
    where: str
    reason: str


Row = dict[str, Any]


def hub_rows(settings: DataParams) -> Iterator[Row]:
    from datasets import load_dataset

    check_hub_dataset(settings.source)  # one line for a typo or an unreachable hub, at once
    try:
        rows = load_dataset(settings.source, name=settings.config, split=settings.split,
                            revision=settings.revision)
    except Exception as error:  # noqa: BLE001 - the hub client raises many types (offline, id)
        raise DataError(f"data.source {settings.source!r} (config {settings.config!r}, split "
                        f"{settings.split!r}) could not be loaded: {type(error).__name__}: "
                        f"{str(error)[:300]}") from None
    for index, row in enumerate(rows, 1):
        row = dict(row)
        if row.get("decoded_image") is not None:  # MathVista: `image` is the path in its repo
            row["image"] = row.pop("decoded_image")
        row[ORIGIN] = Origin(f"{settings.source}[{settings.split}] row {index}",
                             source=settings.source)
        yield row


def local_rows(path: Path) -> Iterator[Row | BadLine]:
    """Every record file of a directory (sorted by name), one file, or an image folder."""
    metadata = [path / name for name in METADATA_FILES if (path / name).is_file()]
    if path.is_dir() and metadata:
        yield from image_folder_rows(metadata[0])
        return
    files = [path] if path.is_file() else sorted(
        child for child in path.iterdir() if child.suffix in RECORD_SUFFIXES)
    if not files:
        raise DataError(f"{path}: no {', '.join(RECORD_SUFFIXES)} file and no "
                        f"{' / '.join(METADATA_FILES)} with records")
    for file in files:
        yield from read_record_file(file)


def image_folder_rows(metadata: Path) -> Iterator[Row | BadLine]:
    for row in read_record_file(metadata):
        if isinstance(row, dict):
            file_name = row.pop("file_name", None)
            if not isinstance(file_name, str) or not file_name.strip():
                yield BadLine(row[ORIGIN].where, "no file_name (the image's path)")
                continue
            row["image"] = file_name
        yield row


def read_record_file(path: Path) -> Iterator[Row | BadLine]:
    readers = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows,
               ".parquet": _parquet_rows}
    if path.suffix not in readers:
        raise DataError(f"{path}: not a {', '.join(RECORD_SUFFIXES)} file")
    rows = 0
    for row in readers[path.suffix](path):
        rows += 1
        if isinstance(row, tuple):
            where, values = row
            source = path.parent.name if path.name in METADATA_FILES else path.name
            values[ORIGIN] = Origin(where, path.parent, source=source)
            yield values
        else:
            yield row
    if not rows:
        yield BadLine(str(path), "the file is empty: it holds no records")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Row] | BadLine]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8").lstrip("\ufeff")
            except UnicodeDecodeError:
                yield BadLine(where, "not UTF-8 text")
                continue
            if line.strip():
                yield _json_object(line.rstrip(), where)


def _json_object(text: str, where: str) -> tuple[str, Row] | BadLine:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        return BadLine(where, f"not valid JSON ({error.msg}: column {error.colno})")
    if not isinstance(row, dict):
        return BadLine(where, f"expected a JSON object, got {type(row).__name__}")
    return where, row


def _json_rows(path: Path) -> Iterator[tuple[str, Row] | BadLine]:
    """A JSON array of objects, or an object of objects (MathVista's testmini.json: pid -> row).
    Invalid JSON makes the whole file one bad line, at the line where parsing stopped."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as error:
        yield BadLine(f"{path}:{error.lineno}", f"not valid JSON ({error.msg}); the whole "
                                                f"file is skipped")
        return
    except UnicodeDecodeError as error:
        yield BadLine(str(path), f"not UTF-8 text (byte {error.start}); the whole file is skipped")
        return
    if isinstance(payload, dict):
        items = [(f"{path}[{key!r}]", row) for key, row in payload.items()]
    elif isinstance(payload, list):
        items = [(f"{path}[{index}]", row) for index, row in enumerate(payload)]
    else:
        yield BadLine(str(path), "expected a JSON array or object of records")
        return
    for where, row in items:
        yield (where, row) if isinstance(row, dict) else BadLine(
            where, f"expected a JSON object, got {type(row).__name__}")


def _csv_rows(path: Path) -> Iterator[tuple[str, Row] | BadLine]:
    """A header line, then one record per row; a row with another number of fields is bad."""
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle)
        header, start = None, 1
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except (csv.Error, UnicodeDecodeError) as error:
                yield BadLine(f"{path}:{start}", f"not readable as CSV ({error})")
                if isinstance(error, UnicodeDecodeError):
                    return
                start = reader.line_num + 1
                continue
            where, start = f"{path}:{start}", reader.line_num + 1
            if not fields:
                continue
            if header is None:
                header = fields
            elif len(fields) != len(header):
                yield BadLine(where, f"expected {len(header)} fields as in the header, got "
                                     f"{len(fields)}")
            else:
                yield where, dict(zip(header, fields, strict=True))


def _parquet_rows(path: Path) -> Iterator[tuple[str, Row] | BadLine]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    index = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            for row in batch.to_pylist():
                index += 1
                yield f"{path} row {index}", row
    except (OSError, pa.ArrowException) as error:
        yield BadLine(f"{path} row {index + 1}", f"not readable as parquet ({error}); the rest "
                                                 f"of the file is skipped")
