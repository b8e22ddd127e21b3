"""Every source (the hub's MathVista, a local directory, the embedded synthetic set) is reduced to
one MathVista-schema row format before anything else sees it, so filters, prompts, the split and
the scorer work the same on all of them. Bad records are kept out with a reason, never silently."""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from vlmrl.params import EMBEDDED_SOURCE, DataParams, ParamsError
from vlmrl.prompts import build_prompt
from vlmrl.tables import markdown_table

COLUMNS = ("pid", "prompt", "image", "answer", "question_type", "answer_type", "choices",
           "precision", "unit", "source", "category", "tier")


class DataError(ValueError):
    """A record or the data set cannot be used; the message names the record or the param."""


@dataclass
class Skipped:
    pid: str
    reason: str


@dataclass
class PreparedData:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    skipped: list[Skipped] = field(default_factory=list)
    filtered_out: int = 0
    total: int = 0


# ---------------------------------------------------------------- sources

def load_raw_records(settings: DataParams) -> Iterator[dict[str, Any]]:
    """Raw MathVista rows; `image` is a PIL image, a path, or None."""
    if settings.source == EMBEDDED_SOURCE:
        from vlmrl.synth import generate, generate_read

        yield from generate(settings.synthetic_size, seed=settings.seed,
                            image_size=settings.image_size)
        yield from generate_read(settings.synthetic_read_size, seed=settings.seed,
                                 image_size=settings.image_size)
    elif Path(settings.source).exists():
        yield from load_local_records(Path(settings.source))
    elif "/" in settings.source:
        yield from load_hub_records(settings.source, settings.split)
    else:
        raise ParamsError(f"params.yaml `data.source` {settings.source!r} is neither "
                          f"{EMBEDDED_SOURCE!r}, an existing directory, nor a hub dataset id")


def load_hub_records(dataset_id: str, split: str) -> Iterator[dict[str, Any]]:
    from datasets import load_dataset

    for row in load_dataset(dataset_id, split=split):
        row = dict(row)
        if row.get("decoded_image") is not None:
            row["image"] = row.pop("decoded_image")
        yield row


def load_local_records(directory: Path) -> Iterator[dict[str, Any]]:
    """A directory in MathVista's schema: data.jsonl, *.parquet or *.json, image paths relative
    to the directory."""
    if directory.is_file():
        directory, files = directory.parent, [directory]
    else:
        files = sorted([*directory.glob("*.jsonl"), *directory.glob("*.parquet"),
                        *directory.glob("*.json")])
    if not files:
        raise DataError(f"{directory}: no .jsonl, .parquet or .json file with records")
    for path in files:
        for row in read_record_file(path):
            image = row.get("image")
            if isinstance(image, str) and image:
                row["image"] = directory / image
            yield row


def read_record_file(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pandas as pd

        yield from pd.read_parquet(path).to_dict(orient="records")
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, 1):
                if line.strip():
                    yield _json_object(line, f"{path}:{line_number}")
    else:
        payload = json.loads(path.read_text(encoding="utf-8"))
        rows = payload.values() if isinstance(payload, dict) else payload
        yield from (dict(row) for row in rows)


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object per line")
    return row


# ---------------------------------------------------------------- validation

def clean_optional(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def validate_record(raw: Mapping[str, Any], image_size: int) -> dict[str, Any]:
    """A clean record, or DataError with the reason."""
    answer = clean_optional(raw.get("answer"))
    if answer is None or str(answer).strip() == "":
        raise DataError("missing answer")
    record = {
        "pid": str(raw["pid"]),
        "question": str(raw.get("question") or "").strip(),
        "answer": str(answer).strip(),
        "question_type": str(raw.get("question_type") or ""),
        "answer_type": str(raw.get("answer_type") or ""),
        "choices": _choices(raw.get("choices")),
        "precision": _precision(raw.get("precision")),
        "unit": clean_optional(raw.get("unit")) or None,
    }
    if not record["question"]:
        raise DataError("missing question")
    _check_answer(record)
    metadata = clean_optional(raw.get("metadata")) or {}
    record["source"] = str(metadata.get("source") or "unknown")
    record["category"] = str(metadata.get("context") or metadata.get("category") or "unknown")
    record["tier"] = str((metadata.get("synth") or {}).get("tier") or "unknown")
    record["image"] = load_image(raw.get("image"), image_size)
    return record


def _choices(value: Any) -> list[str] | None:
    value = clean_optional(value)
    if not value:
        return None
    return [str(choice) for choice in value]


def _precision(value: Any) -> float | None:
    value = clean_optional(value)
    return None if value is None else float(value)


def _check_answer(record: Mapping[str, Any]) -> None:
    answer, answer_type = record["answer"], record["answer_type"]
    if record["question_type"] == "multi_choice":
        if not record["choices"]:
            raise DataError("multiple-choice question without choices")
        if answer not in record["choices"]:
            raise DataError(f"answer {answer!r} is not one of the choices")
    elif answer_type in ("integer", "float"):
        try:
            number = float(answer)
        except ValueError:
            raise DataError(f"non-numeric answer {answer!r} for answer_type {answer_type}") from None
        if answer_type == "integer" and number != int(number):
            raise DataError(f"answer {answer!r} is not an integer")


def load_image(source: Any, image_size: int) -> Image.Image:
    """RGB, longest side `image_size` (aspect ratio kept)."""
    if source is None:
        raise DataError("no image")
    try:
        image = source if isinstance(source, Image.Image) else _open_image(source)
        image.load()
    except DataError:
        raise
    except Exception as error:  # PIL raises many types for broken files
        raise DataError(f"unreadable image ({type(error).__name__}: {error})") from None
    return resize_longest(image.convert("RGB"), image_size)


def _open_image(source: Any) -> Image.Image:
    if isinstance(source, Mapping) and source.get("bytes"):
        import io

        return Image.open(io.BytesIO(source["bytes"]))
    if isinstance(source, Mapping) and source.get("path"):
        source = source["path"]
    path = Path(str(source))
    if not path.is_file():
        raise DataError(f"image file not found: {path}")
    return Image.open(path)


def resize_longest(image: Image.Image, size: int) -> Image.Image:
    scale = size / max(image.size)
    if scale == 1:
        return image
    width, height = (max(1, round(side * scale)) for side in image.size)
    return image.resize((width, height), Image.Resampling.BICUBIC)


# ---------------------------------------------------------------- pipeline

def passes_filters(raw: Mapping[str, Any], settings: DataParams) -> bool:
    return (raw.get("question_type") in settings.question_types
            and raw.get("answer_type") in settings.answer_types)


def prepare(raw_records: Iterable[Mapping[str, Any]], settings: DataParams) -> PreparedData:
    rows, skipped, filtered_out, total = [], [], 0, 0
    for raw in raw_records:
        total += 1
        if not passes_filters(raw, settings):
            filtered_out += 1
            continue
        pid = str(raw.get("pid", f"#{total}"))
        try:
            record = validate_record(raw, settings.image_size)
        except DataError as error:
            if settings.strict:
                raise DataError(f"record pid={pid}: {error} (data.strict is true)") from None
            skipped.append(Skipped(pid, str(error)))
            continue
        rows.append(to_row(record, settings.system_prompt))
    if not rows:
        raise DataError(
            f"no records left after filtering {total} records by data.question_types="
            f"{list(settings.question_types)} and data.answer_types={list(settings.answer_types)}"
            f" ({len(skipped)} skipped as bad)")
    train, eval_rows = split_by_pid(rows, settings.eval_size, settings.seed)
    return PreparedData(train, eval_rows, skipped, filtered_out, total)


def to_row(record: Mapping[str, Any], system_prompt: str) -> dict[str, Any]:
    row = {key: record[key] for key in COLUMNS if key in record}
    row.setdefault("tier", "unknown")  # records from outside validate_record carry none
    row["prompt"] = build_prompt(record, system_prompt)
    return row


def split_by_pid(rows: list[dict[str, Any]], eval_size: int, seed: int):
    """Eval membership depends only on the pid and the seed, never on the order of the source."""
    if eval_size >= len(rows):
        raise ParamsError(f"params.yaml `data.eval_size` is {eval_size} but only {len(rows)} "
                          f"records passed the filters; nothing would be left to train on")
    ranked = sorted(rows, key=lambda row: _pid_rank(row["pid"], seed))
    eval_pids = {row["pid"] for row in ranked[:eval_size]}
    train = [row for row in rows if row["pid"] not in eval_pids]
    eval_rows = [row for row in rows if row["pid"] in eval_pids]
    return train, eval_rows


def _pid_rank(pid: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest()


# ---------------------------------------------------------------- writing

def to_dataset(rows: list[dict[str, Any]]):
    from datasets import Dataset, Features, Sequence, Value
    from datasets import Image as ImageFeature

    features = Features({
        "pid": Value("string"),
        "prompt": [{"role": Value("string"),
                    "content": [{"type": Value("string"), "text": Value("string")}]}],
        "image": ImageFeature(),
        "answer": Value("string"),
        "question_type": Value("string"),
        "answer_type": Value("string"),
        "choices": Sequence(Value("string")),
        "precision": Value("float64"),
        "unit": Value("string"),
        "source": Value("string"),
        "category": Value("string"),
        "tier": Value("string"),
    })
    return Dataset.from_list(rows, features=features)


def data_summary(prepared: PreparedData) -> dict[str, Any]:
    def counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "n": len(rows),
            "by_type": dict(Counter(f"{r['question_type']}/{r['answer_type']}" for r in rows)),
            "by_source": dict(Counter(r["source"] for r in rows)),
            "by_category": dict(Counter(r["category"] for r in rows)),
            "by_tier": dict(Counter(r.get("tier", "unknown") for r in rows)),
        }

    skip_reasons = Counter(s.reason.split(" (")[0].split(":")[0] for s in prepared.skipped)
    return {"total_records": prepared.total, "filtered_out": prepared.filtered_out,
            "skipped": len(prepared.skipped), "skip_reasons": dict(skip_reasons),
            "train": counts(prepared.train), "eval": counts(prepared.eval)}


def render_report(prepared: PreparedData, settings: DataParams) -> str:
    summary = data_summary(prepared)
    lines = ["# Data report", "",
             f"Source: `{settings.source}`; filters: question_types={list(settings.question_types)},"
             f" answer_types={list(settings.answer_types)}; image size {settings.image_size}.", "",
             "| | count |", "| --- | ---: |",
             f"| records read | {summary['total_records']} |",
             f"| filtered out | {summary['filtered_out']} |",
             f"| skipped (bad) | {summary['skipped']} |",
             f"| train | {summary['train']['n']} |", f"| eval | {summary['eval']['n']} |", ""]
    for title, key in (("type", "by_type"), ("source", "by_source"), ("category", "by_category")):
        lines += [f"## By {title}", "", f"| {title} | train | eval |", "| --- | ---: | ---: |"]
        names = sorted(set(summary["train"][key]) | set(summary["eval"][key]))
        lines += [f"| {name} | {summary['train'][key].get(name, 0)} | "
                  f"{summary['eval'][key].get(name, 0)} |" for name in names]
        lines.append("")
    tiers = sorted(set(summary["train"]["by_tier"]) | set(summary["eval"]["by_tier"]))
    lines += ["## By tier", "", markdown_table(
        ("tier", "train", "eval"),
        [(tier, summary["train"]["by_tier"].get(tier, 0), summary["eval"]["by_tier"].get(tier, 0))
         for tier in tiers], align=("left", "right", "right")), ""]
    lines += ["## Skipped records", ""]
    if prepared.skipped:
        lines += ["| pid | reason |", "| --- | --- |"]
        lines += [f"| {s.pid} | {s.reason.replace('|', '/')} |" for s in prepared.skipped]
    else:
        lines.append("None.")
    return "\n".join(lines) + "\n"
