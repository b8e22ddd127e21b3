"""A dataset's own column names and answer format are params, not code: `data.columns` maps
its columns onto the record fields, `data.answer_pattern` pulls the final answer out of a worked
solution (GSM8K's `... #### 72`), and what the data leaves out is derived the same way on every
machine (the id, the question and answer types).

Derived ids: `auto-` + the first 16 hex digits of the SHA-256 of the JSON object
{"question", "answer", "image"} of the record as written in the data (the answer before
extraction; the image as its path in the data, or the SHA-256 of its bytes or pixels). The id
depends on the content only: it survives reordering, added records and a changed
`answer_pattern`, and two records with the same question, answer and image get the same id (the
second is skipped as a duplicate)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

from vlmrl.errors import UserError
from vlmrl.params import DataParams, ParamsError, RecordField
from vlmrl.rewards.scoring import parse_number

# The record fields `data.columns` maps dataset columns onto (`id` becomes the record's pid).
RECORD_FIELDS: tuple[str, ...] = get_args(RecordField)
DEFAULT_COLUMNS: dict[str, str] = {**{field: field for field in RECORD_FIELDS}, "id": "pid"}
# Named `data.answer_pattern` rules. after_hashes: GSM8K's "<worked solution> #### 72".
ANSWER_RULES: dict[str, str] = {"after_hashes": r"####\s*(.+?)\s*$"}
# Where a row came from (`vlmrl.data.sources.Origin`); a key no dataset column uses.
ORIGIN = "__origin__"
_INTEGER = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.(\d*)|\.(\d+))")
_WRITTEN_DECIMALS = re.compile(r"\d*\.(\d+)")


class DataError(UserError, ValueError):
    """A record or the data set cannot be used; the message names the record or the param."""


# ------------------------------------------------------------------ params


@functools.lru_cache(maxsize=8)
def answer_regex(pattern: str) -> re.Pattern[str]:
    """A named rule (ANSWER_RULES) or a regular expression with one group, or a group named
    `answer`, around the final answer; else ParamsError."""
    try:
        compiled = re.compile(ANSWER_RULES.get(pattern, pattern), re.DOTALL)
    except re.error as error:
        raise ParamsError(f"params.yaml data.answer_pattern: {pattern!r} is not a regular "
                          f"expression ({error})") from None
    if compiled.groups != 1 and "answer" not in compiled.groupindex:
        raise ParamsError(f"params.yaml data.answer_pattern: {pattern!r} needs one group (or a "
                          f"group named `answer`) around the answer; named rules: "
                          f"{', '.join(ANSWER_RULES)}")
    return compiled


def check_mapping(settings: DataParams) -> None:
    """The mapping params that pydantic cannot check: the answer pattern and column names."""
    if settings.answer_pattern is not None:
        answer_regex(settings.answer_pattern)
    empty = sorted(field for field, column in settings.columns.items() if not column.strip())
    if empty:
        raise ParamsError(f"params.yaml data.columns: {empty} must name a column")


# ------------------------------------------------------------------ mapping


def map_record(raw: Mapping[str, Any], settings: DataParams) -> dict[str, Any]:
    """A dataset row as a MathVista-schema row (pid, question, answer, image, choices, types,
    precision, unit, source, category, metadata, and `origin`: the file or dataset it came
    from), or DataError naming the field and column."""
    columns = {**DEFAULT_COLUMNS, **settings.columns}
    value = {field: _present(raw.get(column)) for field, column in columns.items()}
    for required in ("question", "answer"):
        if value[required] is None:
            raise DataError(f"missing {required} (column {columns[required]!r})")
    question, written_answer = str(value["question"]).strip(), str(value["answer"]).strip()
    answer = extract_answer(written_answer, settings)
    origin = raw.get(ORIGIN)
    image = value["image"]
    pid = value["id"]
    if pid is None:
        pid = derive_id(question, written_answer, image)
    choices = _choices(value["choices"])
    answer, answer_type = typed_gold(answer, value["answer_type"])
    precision = value["precision"]
    if precision is None and value["answer_type"] is None and answer_type == "float":
        precision = decimals(answer)
    return {
        "pid": str(pid), "question": question, "answer": answer,
        "image": _resolve(image, getattr(origin, "base", None)),
        "choices": choices,
        "question_type": value["question_type"] or ("multi_choice" if choices else "free_form"),
        "answer_type": answer_type, "precision": precision, "unit": value["unit"],
        "source": value["source"], "category": value["category"],
        "metadata": raw.get("metadata"), "origin": getattr(origin, "source", None),
    }


def extract_answer(written: str, settings: DataParams) -> str:
    if settings.answer_pattern is None:
        return written
    regex = answer_regex(settings.answer_pattern)
    match = regex.search(written)
    found = None
    if match is not None:
        found = match.group("answer" if "answer" in regex.groupindex else 1)
    if not found or not found.strip():
        raise DataError(f"answer {written[-60:]!r} does not match data.answer_pattern "
                        f"{settings.answer_pattern!r}")
    return found.strip()


def typed_gold(answer: str, given_type: str | None) -> tuple[str, str]:
    """(the gold, its answer type). A number the scorer reads from a written form ("64,216",
    "$3.50", "45%", "12 cm", "\\boxed{7}") becomes the plain number ("64216"), so that its type is
    integer or float, where the data gives no type or a numeric one; other golds stay as written.
    The type is the one given, else derived from the gold."""
    if given_type in (None, "integer", "float") and infer_answer_type(answer) == "text":
        answer = plain_number(answer) or answer
    return answer, given_type or infer_answer_type(answer)


def plain_number(answer: str) -> str | None:
    """The number the scorer reads in `answer` (vlmrl.rewards.scoring.parse_number), written with as many
    decimals as the answer has; None where it reads none, or where the number is not the one
    written (a fraction such as "1/3", whose decimals never end, stays text)."""
    value = parse_number(answer)
    if value is None:
        return None
    written = _WRITTEN_DECIMALS.search(answer)
    places = len(written.group(1)) if written else 0
    if not math.isclose(round(value, places), value, rel_tol=0, abs_tol=1e-9):
        return None
    return str(round(value)) if places == 0 else f"{value:.{places}f}"


def infer_answer_type(answer: str) -> str:
    if _INTEGER.fullmatch(answer):
        return "integer"
    return "float" if _FLOAT.fullmatch(answer) else "text"


def decimals(answer: str) -> int:
    match = _FLOAT.fullmatch(answer)
    return max(1, len((match.group(2) or match.group(3) or "") if match else ""))


def derive_id(question: str, written_answer: str, image: Any) -> str:
    key = json.dumps({"question": question, "answer": written_answer,
                      "image": image_reference(image)}, sort_keys=True, ensure_ascii=False)
    return "auto-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def image_reference(image: Any) -> str | None:
    """The image as the data names it: its path as written, else a digest of its content."""
    if image is None:
        return None
    if isinstance(image, Mapping):
        if image.get("bytes"):
            return "sha256:" + hashlib.sha256(image["bytes"]).hexdigest()
        return None if image.get("path") is None else str(image["path"])
    if isinstance(image, (str, Path)):
        return Path(image).as_posix()
    if isinstance(image, (bytes, bytearray)):
        return "sha256:" + hashlib.sha256(image).hexdigest()
    if hasattr(image, "tobytes"):  # a decoded PIL image (hub datasets' Image feature)
        header = f"{getattr(image, 'mode', '')}:{getattr(image, 'size', '')}:".encode()
        return "sha256:" + hashlib.sha256(header + image.tobytes()).hexdigest()
    raise DataError(f"image must be a path, bytes or an image, got {type(image).__name__}")


def _present(value: Any) -> Any:
    """None for what a dataset writes for "no value": null, NaN, an empty or blank string."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str) and not value.strip():
        return None
    return value.tolist() if hasattr(value, "tolist") else value


def _choices(value: Any) -> list[str] | None:
    if isinstance(value, str):  # a CSV cell holds the list as JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"choices {value[:60]!r} is not a JSON list") from None
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    if not isinstance(value, (list, tuple)):
        raise DataError(f"choices must be a list, got {type(value).__name__}")
    return [str(choice) for choice in value]


def _resolve(image: Any, base: Path | None) -> Any:
    """A relative image path is relative to the data file's directory."""
    if isinstance(image, str) and base is not None:
        return base / image
    return image
