"""data.columns, data.answer_pattern and what is derived when the data leaves it out: GSM8K-style
rows (`... #### 72`, no id, no image) come out as text-only records with the final answer, an
inferred answer type and an id that is the same on every load."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from PIL import Image

from vlmrl.data import load_raw_records, prepare, to_dataset
from vlmrl.data_columns import derive_id, infer_answer_type
from vlmrl.params import DataParams, ParamsError

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?",
     "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A pen costs 2.5 dollars. What do 3 pens cost?",
     "answer": "3 * 2.5 = 7.5\n#### 7.5"},
    {"question": "Sam reads 12 pages a day for 6 days. How many pages?",
     "answer": "12 * 6 = <<12*6=72>>72\n#### 72"},
    {"question": "Which colour is the sky on a clear day?", "answer": "It is\n#### blue"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def local(path: Path, **values) -> DataParams:
    return DataParams(**{"source": "local", "path": str(path), "eval_size": 1,
                         "answer_types": ("integer", "float", "text"), **values})


def prepared_rows(settings: DataParams) -> list[dict]:
    prepared = prepare(load_raw_records(settings), settings)
    return prepared.train + prepared.eval


def test_gsm8k_answers_after_hashes_become_text_only_records(tmp_path: Path) -> None:
    settings = local(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS),
                     answer_pattern="after_hashes")
    rows = {row["answer"]: row for row in prepared_rows(settings)}
    assert set(rows) == {"7", "7.5", "72", "blue"}
    assert {answer: row["answer_type"] for answer, row in rows.items()} == {
        "7": "integer", "7.5": "float", "72": "integer", "blue": "text"}
    assert rows["7.5"]["precision"] == 1.0
    assert all(row["question_type"] == "free_form" for row in rows.values())
    assert all(row["image"] is None for row in rows.values())
    user = rows["72"]["prompt"][1]
    assert [part["type"] for part in user["content"]] == ["text"]
    assert user["content"][0]["text"].startswith("Sam reads 12 pages")


def test_text_only_rows_keep_an_image_column_of_none(tmp_path: Path) -> None:
    from datasets import load_from_disk

    settings = local(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS),
                     answer_pattern="after_hashes")
    to_dataset(prepared_rows(settings)).save_to_disk(str(tmp_path / "prepared"))
    dataset = load_from_disk(str(tmp_path / "prepared"))
    assert "image" in dataset.column_names
    assert dataset["image"] == [None] * 4


def test_an_answer_without_hashes_is_skipped_with_the_pattern(tmp_path: Path) -> None:
    rows = [*GSM8K_ROWS, {"question": "How many legs has a cat?", "answer": "Four legs."}]
    settings = local(write_jsonl(tmp_path / "data.jsonl", rows), answer_pattern="after_hashes")
    prepared = prepare(load_raw_records(settings), settings)
    (skipped,) = prepared.skipped
    assert "data.answer_pattern 'after_hashes'" in skipped.reason
    assert skipped.where == f"{tmp_path / 'data.jsonl'}:5"


def test_a_regex_answer_pattern_with_a_named_group(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": f"so the answer is \\boxed{{{i}}}."} for i in range(3)]
    settings = local(write_jsonl(tmp_path / "data.jsonl", rows),
                     answer_pattern=r"\\boxed\{(?P<answer>[^}]*)\}")
    assert sorted(row["answer"] for row in prepared_rows(settings)) == ["0", "1", "2"]


@pytest.mark.parametrize(("pattern", "problem"), [("####\\s*.+", "needs one group"),
                                                  ("(unclosed", "not a regular expression")])
def test_a_bad_answer_pattern_names_the_param(tmp_path: Path, pattern: str, problem: str) -> None:
    settings = local(write_jsonl(tmp_path / "data.jsonl", GSM8K_ROWS), answer_pattern=pattern)
    with pytest.raises(ParamsError, match=f"data.answer_pattern.*{problem}"):
        prepare(load_raw_records(settings), settings)


def test_columns_map_other_names_onto_the_record(tmp_path: Path) -> None:
    rows = [{"uid": f"u{i}", "problem": f"What is {i} + 1?", "solution": str(i + 1),
             "options": None, "origin": "quiz"} for i in range(4)]
    settings = local(write_jsonl(tmp_path / "data.jsonl", rows),
                     columns={"id": "uid", "question": "problem", "answer": "solution",
                              "choices": "options", "source": "origin"})
    records = {row["pid"]: row for row in prepared_rows(settings)}
    assert set(records) == {"u0", "u1", "u2", "u3"}
    assert records["u2"]["answer"] == "3" and records["u2"]["source"] == "quiz"
    assert "What is 2 + 1?" in records["u2"]["prompt"][1]["content"][0]["text"]


def test_mapped_choices_make_a_multiple_choice_record(tmp_path: Path) -> None:
    rows = [{"q": f"Pick {letter}", "a": letter, "opts": ["x", "y", letter]}
            for letter in ("p", "q", "r")]
    settings = local(write_jsonl(tmp_path / "data.jsonl", rows),
                     question_types=("multi_choice",),
                     columns={"question": "q", "answer": "a", "choices": "opts"})
    records = prepared_rows(settings)
    assert {(r["question_type"], r["answer_type"]) for r in records} == {("multi_choice", "text")}
    assert "Choices:\n(A) x\n(B) y" in records[0]["prompt"][1]["content"][0]["text"]


def test_a_mapped_column_missing_from_the_data_names_the_param(tmp_path: Path) -> None:
    settings = local(write_jsonl(tmp_path / "data.jsonl", GSM8K_ROWS),
                     columns={"question": "problem"})
    with pytest.raises(ParamsError, match=r"data.columns.question: no column 'problem'.*"
                                          r"\['answer', 'question'\]"):
        prepare(load_raw_records(settings), settings)
    strict = local(tmp_path / "data.jsonl", columns={"question": "problem"}, strict=True)
    with pytest.raises(ValueError, match=r"data.jsonl:1: .*missing question \(column 'problem'\)"):
        prepare(load_raw_records(strict), strict)


def test_unknown_record_field_in_columns() -> None:
    with pytest.raises(ParamsError, match=r"data.columns.*'questoin'"):
        DataParams.from_params({"columns": {"questoin": "q"}})


def test_derived_ids_are_stable_and_follow_the_documented_formula(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", GSM8K_ROWS)
    settings = local(path, answer_pattern="after_hashes")
    first = sorted(row["pid"] for row in prepared_rows(settings))
    write_jsonl(path, list(reversed(GSM8K_ROWS)))
    again = sorted(row["pid"] for row in prepared_rows(local(path)))  # no pattern, reordered
    assert first == again and len(set(first)) == 4
    row = GSM8K_ROWS[0]
    key = json.dumps({"question": row["question"], "answer": row["answer"], "image": None},
                     sort_keys=True, ensure_ascii=False)
    assert f"auto-{hashlib.sha256(key.encode()).hexdigest()[:16]}" in first


def test_derived_ids_tell_records_apart_by_image(tmp_path: Path) -> None:
    red, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    assert derive_id("q", "1", red) == derive_id("q", "1", red.copy())
    assert derive_id("q", "1", red) != derive_id("q", "1", blue)
    assert derive_id("q", "1", "images/a.png") != derive_id("q", "1", "images/b.png")
    assert derive_id("q", "1", None) != derive_id("q", "2", None)


def test_a_duplicate_record_is_skipped(tmp_path: Path) -> None:
    settings = local(write_jsonl(tmp_path / "data.jsonl", [*GSM8K_ROWS, GSM8K_ROWS[1]]),
                     answer_pattern="after_hashes")
    prepared = prepare(load_raw_records(settings), settings)
    (skipped,) = prepared.skipped
    assert "duplicate id" in skipped.reason and skipped.where.endswith("data.jsonl:5")
    assert len(prepared.train) + len(prepared.eval) == 4


@pytest.mark.parametrize(("answer", "kind"), [("72", "integer"), ("-3", "integer"),
                                              ("0.25", "float"), ("-.5", "float"),
                                              ("1,000", "text"), ("B", "text")])
def test_answer_type_inferred_from_the_gold(answer: str, kind: str) -> None:
    assert infer_answer_type(answer) == kind
