"""data.columns, data.answer_pattern and what is derived when the data leaves it out: GSM8K-style
rows (`... #### 72`, no id, no image) come out as text-only records with the final answer, an
inferred answer type and an id that is the same on every load."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from PIL import Image
from project_repo import copy_project, run, stage_command, update_params

from vlmrl.data.columns import DataError, derive_id, infer_answer_type
from vlmrl.data.prepare import data_summary, load_raw_records, prepare, render_report, to_dataset
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
    assert skipped.reason.endswith("data.jsonl:2 has the same id")  # the earlier record's line
    assert len(prepared.train) + len(prepared.eval) == 4


def test_an_empty_file_or_folder_is_named_empty(tmp_path: Path) -> None:
    empty_file = tmp_path / "data.jsonl"
    empty_file.write_text("\n")
    with pytest.raises(DataError, match=r"data\.jsonl: the file is empty: it holds no records"):
        prepare(load_raw_records(local(empty_file)), local(empty_file))
    (tmp_path / "folder").mkdir()
    settings = local(tmp_path / "folder")
    with pytest.raises(DataError, match=r"folder: no \.jsonl, .* file and no metadata"):
        prepare(load_raw_records(settings), settings)
    with pytest.raises(DataError, match=r"^data\.path .*folder is empty: it holds no records$"):
        prepare([], settings)  # a source that yields nothing at all


@pytest.mark.parametrize(("answer", "kind"), [("72", "integer"), ("-3", "integer"),
                                              ("0.25", "float"), ("-.5", "float"),
                                              ("1,000", "text"), ("B", "text")])
def test_answer_type_inferred_from_the_gold(answer: str, kind: str) -> None:
    assert infer_answer_type(answer) == kind


# GSM8K writes large golds with thousands separators; every row here is a good record.
SEPARATED_ROWS = [
    {"question": "A farm has 64,000 hens and buys 216 more. How many hens?",
     "answer": "64,000 + 216 = <<64000+216=64216>>64,216\n#### 64,216"},
    {"question": "A car costs 1,000 dollars a month. What do 12 months cost?",
     "answer": "1,000 * 12 = 12,000\n#### 12,000"},
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "#### 7"},
    {"question": "A ticket costs 1,234.5 dollars. What do 2 tickets cost?",
     "answer": "#### $2,469.00"},
    {"question": "Which colour is the sky on a clear day?", "answer": "It is\n#### blue"},
    {"question": "What is a third as a fraction?", "answer": "#### 1/3"},
]


def test_golds_with_thousands_separators_are_typed_as_numbers(tmp_path: Path) -> None:
    from vlmrl.rewards.scoring import score

    settings = local(write_jsonl(tmp_path / "gsm8k.jsonl", SEPARATED_ROWS),
                     answer_pattern="after_hashes", answer_types=("integer", "float"))
    prepared = prepare(load_raw_records(settings), settings)
    rows = {row["answer"]: row for row in prepared.train + prepared.eval}
    assert {answer: row["answer_type"] for answer, row in rows.items()} == {
        "64216": "integer", "12000": "integer", "7": "integer", "2469.00": "float"}
    assert rows["2469.00"]["precision"] == 2.0
    assert score("<SOLUTION>64,216</SOLUTION>", rows["64216"]).correct
    filtered = {item.pid: item.reason for item in prepared.filtered}
    assert set(filtered.values()) == {
        "answer_type text is not in data.answer_types [integer, float]"}
    assert len(filtered) == 2  # "blue" and "1/3", as written
    report = render_report(prepared, settings)
    assert ("| answer_type text is not in data.answer_types [integer, float] | 2 | "
            f"{', '.join(filtered)} |") in report


def test_report_counts_every_reason_with_example_ids(tmp_path: Path) -> None:
    rows = [{"pid": f"t{i}", "question": f"Which word is number {i}?", "answer": f"w{i}"}
            for i in range(5)]
    rows += [{"pid": f"n{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)}
             for i in range(4)]
    rows += [{"pid": "x1", "question": "Q?"}, {"pid": "x2", "question": "R?"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    path.write_text(path.read_text() + "{not json\n")
    settings = local(path, answer_types=("integer",))
    prepared = prepare(load_raw_records(settings), settings)
    summary = data_summary(prepared)
    assert summary["filter_reasons"] == {
        "answer_type text is not in data.answer_types [integer]": 5}
    assert summary["skip_reasons"] == {"missing answer": 2, "not valid JSON": 1}
    report = render_report(prepared, settings)
    assert "| answer_type text is not in data.answer_types [integer] | 5 | t0, t1, t2 |" in report
    assert "| missing answer | 2 | x1, x2 |" in report
    assert f"| not valid JSON | 1 | {path}:12 |" in report


def test_prepare_data_names_the_report_when_records_were_left_out(tmp_path: Path) -> None:
    project = copy_project(tmp_path / "project")
    write_jsonl(project / "data/local/gsm8k.jsonl", [*SEPARATED_ROWS, *GSM8K_ROWS[:3]])
    params = {"data.source": "local", "data.path": "data/local/gsm8k.jsonl", "data.eval_size": 2,
              "data.answer_pattern": "after_hashes", "data.answer_types": ["integer"]}
    update_params(project, params)
    result = run(stage_command("prepare_data", project), project)
    assert ("(4 filtered out, 0 skipped: the reasons, with example ids, are in "
            "data/reports/data_report.md)") in result.stdout
    update_params(project, {"data.answer_types": ["integer", "float", "text"]})
    result = run(stage_command("prepare_data", project), project)
    assert "(0 filtered out, 0 skipped)" in result.stdout
