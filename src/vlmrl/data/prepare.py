"""Every source (a hub dataset, a local file or directory, the embedded synthetic set) is reduced
to one MathVista-schema row format before anything else sees it, so filters, prompts, the split
and the scorer work the same on all of them. Bad records and bad lines are kept out with a reason
and where they were read, never silently. A record without an image is a text-only record: its
image stays None into the prepared rows, and its prompt has no image placeholder.

Where rows come from: vlmrl.data.sources; how their columns map onto the record and what is
derived when the data leaves it out (ids, types): vlmrl.data.columns."""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from vlmrl.data.columns import ORIGIN, DataError, check_mapping, map_record
from vlmrl.data.prompts import SYSTEM_PROMPT, build_prompt
from vlmrl.data.sources import BadLine, Origin, hub_rows, local_rows
from vlmrl.params import (
    EMBEDDED_SOURCE,
    EMBEDDED_TEXT_SOURCE,
    LOCAL_SOURCE,
    DataParams,
    ParamsError,
)
from vlmrl.reporting.tables import markdown_table

COLUMNS = ("pid", "prompt", "image", "answer", "question_type", "answer_type", "choices",
           "precision", "unit", "source", "category", "tier")


@dataclass
class Skipped:
    pid: str
    reason: str
    where: str = ""  # file:line (or hub row) it was read from; empty for in-memory records


@dataclass
class PreparedData:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    skipped: list[Skipped] = field(default_factory=list)
    filtered: list[Skipped] = field(default_factory=list)  # good records data.*_types leave out
    total: int = 0

    @property
    def filtered_out(self) -> int:
        return len(self.filtered)


# ---------------------------------------------------------------- sources

def load_raw_records(settings: DataParams) -> Iterator[dict[str, Any] | BadLine]:
    """Raw rows of the configured source; `image` is a PIL image, a path, or None."""
    if settings.source == EMBEDDED_SOURCE:
        from vlmrl.data.synth import generate, generate_read

        yield from generate(settings.synthetic_size, seed=settings.seed,
                            image_size=settings.image_size)
        yield from generate_read(settings.synthetic_read_size, seed=settings.seed,
                                 image_size=settings.image_size)
    elif settings.source == EMBEDDED_TEXT_SOURCE:
        from vlmrl.data.synth.arithmetic import generate_arithmetic

        for index, row in enumerate(generate_arithmetic(settings.synthetic_size,
                                                        seed=settings.seed), 1):
            yield {**row, ORIGIN: Origin(f"{settings.source} row {index}",
                                         source=settings.source)}
    elif settings.source == LOCAL_SOURCE or Path(settings.source).exists():
        yield from local_rows(local_path(settings))
    elif "/" in settings.source:
        yield from hub_rows(settings)
    else:
        raise ParamsError(f"params.yaml `data.source` {settings.source!r} is neither "
                          f"{EMBEDDED_SOURCE!r}, {EMBEDDED_TEXT_SOURCE!r}, {LOCAL_SOURCE!r} "
                          f"(data.path), nor a hub "
                          f"dataset id")


def local_path(settings: DataParams) -> Path:
    """data.path, the DVC dependency of prepare_data; a path written in data.source must be the
    same, or editing the data would not rerun the stage."""
    path = Path(settings.path)
    if settings.source != LOCAL_SOURCE and Path(settings.source).resolve() != path.resolve():
        raise ParamsError(
            f"params.yaml `data.source` names the local path {settings.source!r}, but "
            f"`data.path` (what dvc.yaml makes prepare_data depend on) is {settings.path!r}: "
            f"set data.source: {LOCAL_SOURCE} and data.path: {settings.source}")
    if not path.exists():
        raise ParamsError(f"params.yaml `data.path` {settings.path!r}: no such file or directory")
    return path



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
    record.update(labels(raw))
    image = clean_optional(raw.get("image"))
    record["image"] = None if image is None else load_image(image, image_size)
    return record


def labels(raw: Mapping[str, Any]) -> dict[str, str | None]:
    """What reports group records by, as far as the data says: the source (its column, the
    metadata's, else the file or dataset the record came from), the category and the tier
    (None where the data has none, so that reports leave them out)."""
    metadata = clean_optional(raw.get("metadata")) or {}
    category = raw.get("category") or metadata.get("context") or metadata.get("category")
    tier = (metadata.get("synth") or {}).get("tier")
    return {"source": str(raw.get("source") or metadata.get("source") or raw.get("origin")
                          or "unknown"),
            "category": None if category is None else str(category),
            "tier": None if tier is None else str(tier)}


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
        source = source["bytes"]
    if isinstance(source, (bytes, bytearray)):
        import io

        return Image.open(io.BytesIO(source))
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

def filter_reason(raw: Mapping[str, Any], settings: DataParams) -> str | None:
    """Why data.question_types or data.answer_types leave the record out; None if they keep it."""
    for key, allowed in (("question_type", settings.question_types),
                         ("answer_type", settings.answer_types)):
        if raw.get(key) not in allowed:
            return f"{key} {raw.get(key)} is not in data.{key}s [{', '.join(allowed)}]"
    return None


def prepare(raw_records: Iterable[Mapping[str, Any] | BadLine],
            settings: DataParams, system_prompt: str = SYSTEM_PROMPT) -> PreparedData:
    """Map, filter and validate every row; skip (or, under data.strict, fail on) bad ones.
    `system_prompt`: the run's answer format's (params.yaml `answer_format`)."""
    check_mapping(settings)
    rows: list[dict[str, Any]] = []
    prepared = PreparedData(train=[], eval=[])
    seen_columns: set[str] = set()
    seen_pids: dict[str, str] = {}  # pid -> where its first record was read
    for raw in raw_records:
        prepared.total += 1
        if isinstance(raw, BadLine):
            _reject(prepared, Skipped("-", raw.reason, raw.where), settings)
            continue
        seen_columns.update(key for key in raw if key != ORIGIN)
        where = getattr(raw.get(ORIGIN), "where", "")
        pid = str(raw.get(settings.columns.get("id", "pid")) or f"#{prepared.total}")
        try:
            mapped = map_record(raw, settings)
            pid = mapped["pid"]
            reason = filter_reason(mapped, settings)
            if reason is not None:
                prepared.filtered.append(Skipped(pid, reason, where))
                continue
            record = validate_record(mapped, settings.image_size)
            if pid in seen_pids:
                raise DataError(f"duplicate id: {seen_pids[pid] or 'an earlier record'} has the "
                                "same id")
        except DataError as error:
            _reject(prepared, Skipped(pid, str(error), where), settings)
            continue
        seen_pids[pid] = where
        rows.append(to_row(record, system_prompt))
    if prepared.total == 0:
        raise DataError(f"{source_name(settings)} is empty: it holds no records")
    check_mapped_columns(settings, seen_columns)
    if not rows:
        first = prepared.skipped[0] if prepared.skipped else None
        example = f": {first.where or first.pid}: {first.reason}" if first else ""
        raise DataError(
            f"no records left after filtering {prepared.total} records by data.question_types="
            f"{list(settings.question_types)} and data.answer_types={list(settings.answer_types)}"
            f" ({len(prepared.skipped)} skipped as bad{example})")
    prepared.train, prepared.eval = split_by_pid(rows, settings.eval_size, settings.seed)
    return prepared


def source_name(settings: DataParams) -> str:
    """The data as params name it: the local file or folder, else the source."""
    if settings.source == LOCAL_SOURCE:
        return f"data.path {settings.path}"
    return f"data.source {settings.source}"


def _reject(prepared: PreparedData, skipped: Skipped, settings: DataParams) -> None:
    if settings.strict:
        record = "" if skipped.pid == "-" else f"record pid={skipped.pid} "
        where = f"{skipped.where}: " if skipped.where else ""
        raise DataError(f"{where}{record}{skipped.reason} (data.strict is true)")
    prepared.skipped.append(skipped)


def check_mapped_columns(settings: DataParams, seen_columns: set[str]) -> None:
    """A column named in data.columns that no row has is a typo in params, not bad data."""
    if not seen_columns:
        return
    for record_field, column in settings.columns.items():
        if column not in seen_columns:
            raise ParamsError(f"params.yaml data.columns.{record_field}: no column {column!r} in the "
                              f"data; its columns: {sorted(seen_columns)}")


def to_row(record: Mapping[str, Any], system_prompt: str) -> dict[str, Any]:
    row = {key: record[key] for key in COLUMNS if key in record}
    row.setdefault("tier", None)  # records from outside validate_record carry none
    row.setdefault("image", None)
    prompt = build_prompt(record, system_prompt)
    row["prompt"] = prompt if row["image"] is not None else without_image_placeholder(prompt)
    return row


def without_image_placeholder(prompt: list[dict]) -> list[dict]:
    """A text-only record's prompt: the chat template must not reserve image tokens."""
    return [{**message, "content": [part for part in message["content"]
                                    if part.get("type") != "image"]} for message in prompt]


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


def present_counts(rows: list[dict[str, Any]], key: str) -> dict[str, int]:
    """How many rows have each value of `key`; rows without one are not counted."""
    return dict(Counter(row[key] for row in rows if row.get(key) is not None))


def data_summary(prepared: PreparedData) -> dict[str, Any]:
    def counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "n": len(rows),
            "by_type": dict(Counter(f"{r['question_type']}/{r['answer_type']}" for r in rows)),
            "by_source": present_counts(rows, "source"),
            "by_category": present_counts(rows, "category"),
            "by_tier": present_counts(rows, "tier"),
            "text_only": sum(r.get("image") is None for r in rows),
        }

    return {"total_records": prepared.total, "filtered_out": prepared.filtered_out,
            "skipped": len(prepared.skipped),
            "filter_reasons": {reason: n for reason, n, _ in reason_groups(prepared.filtered)},
            "skip_reasons": {reason: n for reason, n, _ in reason_groups(prepared.skipped)},
            "train": counts(prepared.train), "eval": counts(prepared.eval)}


def count_section(title: str, train: dict[str, int], eval_counts: dict[str, int]) -> list[str]:
    """Train and eval counts per value; nothing where no record has a value (a text set has no
    category or tier)."""
    names = sorted(set(train) | set(eval_counts))
    if not names:
        return []
    return [f"## By {title}", "", markdown_table(
        (title, "train", "eval"), [(name, train.get(name, 0), eval_counts.get(name, 0))
                                   for name in names], align=("left", "right", "right")), ""]


EXAMPLES_PER_REASON = 3
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def reason_groups(items: list[Skipped]) -> list[tuple[str, int, str]]:
    """(reason, how many records, a few example ids) per reason, the most frequent first."""
    groups: dict[str, list[Skipped]] = {}
    for item in items:
        groups.setdefault(reason_kind(item.reason), []).append(item)
    return [(reason, len(members), ", ".join(
        member.pid if member.pid != "-" else member.where
        for member in members[:EXAMPLES_PER_REASON]))
        for reason, members in sorted(groups.items(), key=lambda group: -len(group[1]))]


def reason_kind(reason: str) -> str:
    """The reason without the record's own values (quoted answers, parser details), so that
    records with the same problem count together."""
    return _QUOTED.sub("…", reason.split(" (")[0])


def reasons_section(title: str, items: list[Skipped], what: str) -> list[str]:
    if not items:
        return [f"## {title}", "", "None.", ""]
    return [f"## {title}", "", what, "", markdown_table(
        ("reason", "records", "example ids"), reason_groups(items),
        align=("left", "right", "left")), ""]


def render_report(prepared: PreparedData, settings: DataParams) -> str:
    summary = data_summary(prepared)
    lines = ["# Data report", "",
             (f"Source: {settings.describe()}; filters: question_types="
              f"{list(settings.question_types)}, answer_types={list(settings.answer_types)}; "
              f"image size {settings.image_size}."), "",
             "| | count |", "| --- | ---: |",
             f"| records read | {summary['total_records']} |",
             f"| filtered out | {summary['filtered_out']} |",
             f"| skipped (bad) | {summary['skipped']} |",
             f"| train | {summary['train']['n']} |", f"| eval | {summary['eval']['n']} |",
             (f"| text-only (no image), train / eval | {summary['train']['text_only']} / "
              f"{summary['eval']['text_only']} |"), ""]
    for title in ("type", "source", "category", "tier"):
        lines += count_section(title, summary["train"][f"by_{title}"],
                               summary["eval"][f"by_{title}"])
    lines += reasons_section("Filtered out", prepared.filtered,
                             "Good records that data.question_types and data.answer_types leave "
                             "out, by reason:")
    lines += reasons_section("Skipped records", prepared.skipped,
                             "Bad records and lines, by reason (each one is listed below):")
    if prepared.skipped:
        lines.append(markdown_table(("pid", "where", "reason"), [
            (s.pid, s.where or "-", s.reason) for s in prepared.skipped]))
    return "\n".join(lines) + "\n"
