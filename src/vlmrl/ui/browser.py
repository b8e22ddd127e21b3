"""The eval browser's data: baseline and post_eval records paired by pid, each pair's change
(a flip is a flip of `vlmrl.evaluation.report.find_flips`, as in the post_eval report), the headline
metrics, facets and filters; and the prepared eval set (images, questions, gold records).

A missing or broken pipeline output is an `ApiError` that names the file and the `dvc repro`
command that makes it (404 when missing, 503 when unreadable). The eval set loads lazily, once:
importing `datasets` takes seconds, and the reward calculator never needs it.
"""

from __future__ import annotations

import io
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from numbers import Real
from pathlib import Path
from typing import Any

from vlmrl.data.prompts import prompt_question
from vlmrl.evaluation.report import find_flips, headline_rows
from vlmrl.rewards.functions import RECORD_COLUMNS
from vlmrl.ui.errors import ApiError

__all__ = ["CHANGES", "CHANGE_FILTERS", "EVAL_SET_DIR", "EvalSet", "eval_view", "paired_rows"]

EVAL_SET_DIR = "data/prepared/eval"
IMAGE_CACHE_SIZE = 64
# name -> (path relative to the repo, the stage that writes it)
EVAL_FILES = {
    "baseline_records": ("data/eval/baseline/records.jsonl", "baseline_eval"),
    "post_records": ("data/eval/post/records.jsonl", "post_eval"),
    "baseline_metrics": ("data/metrics/baseline_eval.json", "baseline_eval"),
    "post_metrics": ("data/metrics/post_eval.json", "post_eval"),
}
RECORD_FIELDS = (*RECORD_COLUMNS, "pid", "question", "category", "source")
CHANGES = ("wrong_to_right", "right_to_wrong", "still_right", "still_wrong",
           "only_in_baseline", "only_in_post")
CHANGE_FILTERS = ("all", "flipped", *CHANGES)


# ----------------------------------------------------------------- eval data


def missing_outputs(repo: Path) -> list[tuple[str, str]]:
    return [(path, stage) for path, stage in EVAL_FILES.values() if not (repo / path).is_file()]


def missing_message(missing: list[tuple[str, str]]) -> str:
    files = "; ".join(f"{path} (written by {stage})" for path, stage in missing)
    return (f"No before/after evaluation yet: missing {files}. Run `dvc repro post_eval` "
            f"(it runs prepare_data, sft_cold_start, baseline_eval and train_gspo first "
            f"when needed).")


def corrupt(path: str, stage: str, problem: str) -> ApiError:
    return ApiError(503, f"{path}: {problem}; re-run `dvc repro {stage}`", file=path)


def read_jsonl(repo: Path, path: str, stage: str) -> list[dict[str, Any]]:
    records = []
    text = (repo / path).read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise corrupt(path, stage, f"line {number} is not JSON ({error.msg})") from None
        if not isinstance(record, dict) or "pid" not in record:
            raise corrupt(path, stage, f"line {number} is not a record with a pid")
        records.append(record)
    return records


def read_metrics(repo: Path, path: str, stage: str) -> dict[str, Any]:
    try:
        metrics = json.loads((repo / path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise corrupt(path, stage, f"not JSON ({error})") from None
    if not isinstance(metrics, dict):
        raise corrupt(path, stage, "not a JSON object")
    return metrics


def change_of(pid: str, flips: Mapping[str, set[str]], baseline: Mapping[str, Any]) -> str:
    for kind in ("wrong_to_right", "right_to_wrong", "only_in_baseline", "only_in_post"):
        if pid in flips[kind]:
            return kind
    return "still_right" if baseline[pid].get("correct") else "still_wrong"


def paired_rows(baseline_records: list[dict], post_records: list[dict]) -> list[dict[str, Any]]:
    """One row per pid (baseline order, then post-only pids) with both records and the change."""
    flips = {kind: set(pids) for kind, pids in find_flips(baseline_records, post_records).items()}
    baseline = {str(r["pid"]): r for r in baseline_records}
    post = {str(r["pid"]): r for r in post_records}
    rows = []
    for pid in dict.fromkeys([*baseline, *post]):
        either = baseline.get(pid) or post[pid]
        rows.append({"pid": pid, "change": change_of(pid, flips, baseline),
                     **{key: either.get(key) for key in
                        ("question_type", "answer_type", "category", "source", "gold")},
                     "baseline": baseline.get(pid), "post": post.get(pid)})
    return rows


def matches(row: Mapping[str, Any], change: str, question_type: str, category: str) -> bool:
    if change == "flipped" and row["change"] not in ("wrong_to_right", "right_to_wrong"):
        return False
    if change not in ("all", "flipped") and row["change"] != change:
        return False
    if question_type and str(row["question_type"]) != question_type:
        return False
    return not category or str(row["category"]) == category


def headline(baseline_metrics: Mapping[str, Any], post_metrics: Mapping[str, Any]) -> list[dict]:
    rows = [{"key": "n", "label": "Samples", "baseline": baseline_metrics.get("n"),
             "post": post_metrics.get("n"), "delta": None}]
    for row in headline_rows(baseline_metrics, post_metrics):
        numeric = all(isinstance(v, Real) for v in (row.before, row.after))
        rows.append({"key": row.key, "label": row.label, "baseline": row.before,
                     "post": row.after, "delta": row.delta if numeric else None})
    return rows


def facet_values(rows: list[dict[str, Any]], key: str) -> list[str]:
    return sorted({str(row[key]) for row in rows if row[key] is not None})


def eval_view(repo: Path, change: str, question_type: str, category: str) -> dict[str, Any]:
    """The eval browser's data: headline metrics, change counts, facets and the filtered rows."""
    if change not in CHANGE_FILTERS:
        raise ApiError(400, f"change must be one of {', '.join(CHANGE_FILTERS)}, got "
                            f"{json.dumps(change)}", field="change")
    missing = missing_outputs(repo)
    if missing:
        raise ApiError(404, missing_message(missing), stage="post_eval",
                       missing=[path for path, _stage in missing])
    loaded = {name: (read_jsonl if name.endswith("records") else read_metrics)(repo, *spec)
              for name, spec in EVAL_FILES.items()}
    rows = paired_rows(loaded["baseline_records"], loaded["post_records"])
    return {
        "headline": headline(loaded["baseline_metrics"], loaded["post_metrics"]),
        "counts": {kind: sum(row["change"] == kind for row in rows) for kind in CHANGES},
        "question_types": facet_values(rows, "question_type"),
        "categories": facet_values(rows, "category"),
        "total": len(rows),
        "rows": [row for row in rows if matches(row, change, question_type, category)],
    }


# ------------------------------------------------------------------ eval set


class EvalSet:
    """The prepared eval set (`datasets.load_from_disk`), loaded on first use and kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._dataset = None
        self._index: dict[str, int] = {}
        self._records: list[dict[str, Any]] = []
        self._images: OrderedDict[str, bytes] = OrderedDict()

    def _load(self):
        with self._lock:
            if self._dataset is None:
                self._dataset = self._open()
                self._index = {str(pid): i for i, pid in enumerate(self._dataset["pid"])}
                self._records = [gold_record(row) for row in
                                 self._dataset.remove_columns(["image"]).to_list()]
        return self._dataset

    def _open(self):
        if not self.path.is_dir():
            raise ApiError(404, f"No prepared eval set at {EVAL_SET_DIR}: run "
                                f"`dvc repro prepare_data`", stage="prepare_data")
        from datasets import load_from_disk

        try:
            dataset = load_from_disk(str(self.path))
        except Exception as error:  # noqa: BLE001 - any unreadable dataset gets one message
            raise ApiError(503, f"{EVAL_SET_DIR}: cannot load the eval set ({error}); re-run "
                                f"`dvc repro prepare_data`", stage="prepare_data") from None
        if "pid" not in dataset.column_names or "image" not in dataset.column_names:
            raise ApiError(503, f"{EVAL_SET_DIR} lacks a pid or image column; re-run "
                                f"`dvc repro prepare_data`", stage="prepare_data")
        return dataset

    def records(self) -> list[dict[str, Any]]:
        self._load()
        return self._records

    def questions(self) -> dict[str, str | None]:
        """pid -> question text; empty when the eval set is not there (the browser still works)."""
        try:
            return {r["pid"]: r["question"] for r in self.records()}
        except ApiError:
            return {}

    def image_png(self, pid: str) -> bytes:
        dataset = self._load()
        with self._lock:
            if pid in self._images:
                self._images.move_to_end(pid)
                return self._images[pid]
        if pid not in self._index:
            raise ApiError(404, f"no record with pid {pid!r} in {EVAL_SET_DIR}", field="pid")
        image = dataset[self._index[pid]]["image"]
        if image is None:
            raise ApiError(404, f"record {pid!r} is text-only: it has no image", field="pid")
        png = png_bytes(image)
        with self._lock:
            self._images[pid] = png
            if len(self._images) > IMAGE_CACHE_SIZE:
                self._images.popitem(last=False)
        return png


def png_bytes(image) -> bytes:
    if image.mode not in ("1", "L", "LA", "P", "RGB", "RGBA"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def gold_record(row: Mapping[str, Any]) -> dict[str, Any]:
    record = {key: row.get(key) for key in RECORD_FIELDS if key != "question"}
    record["pid"] = str(row.get("pid"))
    record["question"] = prompt_question(row.get("prompt"))
    return record
