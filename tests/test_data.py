"""prepare_data: the embedded set, real MathVista testmini records (with drawn placeholder
images), filters, the split, and every kind of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TEST_PARAMS, TESTMINI, dvc_repro, run, stage_command, update_params
from PIL import Image

from vlmrl.data.prepare import (
    DataError,
    load_raw_records,
    prepare,
    render_report,
    split_by_pid,
)
from vlmrl.data.sources import local_rows
from vlmrl.params import DataParams, ParamsError

needs_testmini = pytest.mark.skipif(not TESTMINI.is_file(), reason=f"{TESTMINI} not present")


def make_testmini_dir(tmp_path: Path, limit: int | None = None) -> Path:
    """testmini.json with a drawn placeholder image per record (the benchmark ships none)."""
    records = json.loads(TESTMINI.read_text())
    rows = list(records.values()) if isinstance(records, dict) else records
    rows = rows[:limit] if limit else rows
    directory = tmp_path / "testmini"
    (directory / "images").mkdir(parents=True)
    for row in rows:
        path = directory / row["image"]
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (96, 64), (200, 220, 240)).save(path)
    (directory / "testmini.json").write_text(json.dumps(rows))
    return directory


@needs_testmini
def test_real_testmini_records(tmp_path: Path) -> None:
    settings = DataParams(source=str(make_testmini_dir(tmp_path)), eval_size=100,
                            question_types=("free_form", "multi_choice"),
                            answer_types=("integer", "float", "text"), image_size=64)
    prepared = prepare(local_rows(Path(settings.source)), settings)
    assert prepared.total == 1000
    assert prepared.filtered_out == 2  # the two list answers
    assert len(prepared.train) + len(prepared.eval) + len(prepared.skipped) == 998
    assert len(prepared.eval) == 100
    assert not {r["pid"] for r in prepared.train} & {r["pid"] for r in prepared.eval}
    multi = next(r for r in prepared.train if r["question_type"] == "multi_choice")
    prompt_text = multi["prompt"][1]["content"][1]["text"]
    assert "Choices:" in prompt_text and "(A) " + multi["choices"][0] in prompt_text
    unit = next(r for r in prepared.train + prepared.eval if r["unit"])
    assert f"(Unit: {unit['unit']})" in unit["prompt"][1]["content"][1]["text"]
    assert max(prepared.train[0]["image"].size) == 64


@needs_testmini
def test_default_filter_keeps_numeric_free_form(tmp_path: Path) -> None:
    settings = DataParams(source=str(make_testmini_dir(tmp_path)), eval_size=50, image_size=32)
    prepared = prepare(local_rows(Path(settings.source)), settings)
    kept = prepared.train + prepared.eval
    assert len(kept) + len(prepared.skipped) == 418 + 40
    assert {r["answer_type"] for r in kept} <= {"integer", "float"}
    assert all(r["question_type"] == "free_form" for r in kept)


def test_split_is_by_pid_and_deterministic() -> None:
    rows = [{"pid": str(i)} for i in range(50)]
    train, eval_rows = split_by_pid(rows, 10, seed=3)
    _, eval2 = split_by_pid(list(reversed(rows)), 10, seed=3)
    assert {r["pid"] for r in eval_rows} == {r["pid"] for r in eval2}
    assert len(eval_rows) == 10 and len(train) == 40
    assert {r["pid"] for r in split_by_pid(rows, 10, seed=4)[1]} != {r["pid"] for r in eval_rows}
    with pytest.raises(ParamsError, match="data.eval_size"):
        split_by_pid(rows, 50, seed=0)


def bad_records(tmp_path: Path) -> list[dict]:
    good = tmp_path / "good.png"
    Image.new("RGB", (40, 40), "white").save(good)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png at all")
    base = {"question": "How many?", "question_type": "free_form", "answer_type": "integer",
            "image": good}
    return [
        dict(base, pid="ok-1", answer="3"),
        dict(base, pid="ok-2", answer="4"),
        dict(base, pid="ok-3", answer="5"),
        dict(base, pid="unreadable", answer="3", image=broken),
        dict(base, pid="missing-file", answer="3", image=tmp_path / "nope.png"),
        dict(base, pid="no-answer", answer=""),
        dict(base, pid="not-a-number", answer="three"),
        dict(base, pid="float-for-int", answer="2.5"),
    ]


def test_bad_records_are_skipped_with_reasons(tmp_path: Path) -> None:
    settings = DataParams(source="x", eval_size=1, image_size=32)
    prepared = prepare(bad_records(tmp_path), settings)
    reasons = {s.pid: s.reason for s in prepared.skipped}
    assert set(reasons) == {"unreadable", "missing-file", "no-answer", "not-a-number",
                            "float-for-int"}
    assert "unreadable image" in reasons["unreadable"]
    assert "not found" in reasons["missing-file"]
    assert "missing answer" in reasons["no-answer"]
    assert "non-numeric" in reasons["not-a-number"]
    assert len(prepared.train) + len(prepared.eval) == 3


def test_strict_mode_names_the_record(tmp_path: Path) -> None:
    settings = DataParams(source="x", eval_size=1, image_size=32, strict=True)
    with pytest.raises(DataError, match="pid=unreadable"):
        prepare(bad_records(tmp_path), settings)


def test_empty_after_filtering_names_the_filter(tmp_path: Path) -> None:
    settings = DataParams(source="x", eval_size=1, answer_types=("float",))
    with pytest.raises(DataError, match="data.answer_types"):
        prepare(bad_records(tmp_path), settings)


def test_embedded_set_carries_tiers_and_the_read_items() -> None:
    settings = DataParams(synthetic_size=24, synthetic_read_size=4, eval_size=3, image_size=64)
    prepared = prepare(load_raw_records(settings), settings)
    rows = prepared.train + prepared.eval
    tiers = {row["pid"]: row["tier"] for row in rows}
    assert {pid for pid, tier in tiers.items() if tier == "read"} == {
        f"synth-read-{i:05d}" for i in range(4)}
    assert set(tiers.values()) == {"read", "chart", "geometry"}
    report = render_report(prepared, settings)
    train_reads = sum(row["tier"] == "read" for row in prepared.train)
    assert "## By tier" in report
    assert f"| read | {train_reads} | {4 - train_reads} |" in report
    with pytest.raises(ParamsError, match="data.synthetic_read_size"):
        DataParams.from_params({"synthetic_read_size": -1})


def test_unknown_data_param() -> None:
    with pytest.raises(ParamsError, match="imagesize"):
        DataParams.from_params({"imagesize": 3})
    with pytest.raises(ParamsError, match="data.answer_types"):
        DataParams.from_params({"answer_types": ["number"]})


@pytest.mark.slow
def test_prepare_data_stage_through_dvc(pipeline_repo: Path) -> None:
    from datasets import load_from_disk

    dvc_repro(pipeline_repo, "prepare_data")
    train = load_from_disk(str(pipeline_repo / "data/prepared/train"))
    eval_set = load_from_disk(str(pipeline_repo / "data/prepared/eval"))
    assert {"pid", "prompt", "image", "answer", "question_type", "answer_type", "choices",
            "precision", "unit"} <= set(train.column_names)
    assert len(eval_set) == TEST_PARAMS["data.eval_size"] and len(train) > 50
    assert not set(train["pid"]) & set(eval_set["pid"])
    assert max(train[0]["image"].size) == 512 and train[0]["image"].mode == "RGB"
    report = (pipeline_repo / "data/reports/data_report.md").read_text()
    assert "## Skipped records" in report and "vlmrl-synth-bar" in report
    summary = json.loads((pipeline_repo / "data/metrics/prepare_data.json").read_text())
    assert summary["train"]["n"] == len(train)
    second = dvc_repro(pipeline_repo, "prepare_data")
    assert "didn't change" in second.stdout


def test_failed_prepare_leaves_no_outputs(fresh_repo: Path) -> None:
    update_params(fresh_repo, {"data.answer_types": ["list"]})
    result = run(stage_command("prepare_data"), fresh_repo, check=False)
    assert result.returncode != 0 and "data.answer_types" in result.stderr
    assert not (fresh_repo / "data/prepared/train").exists()
    assert not (fresh_repo / "data/prepared/eval").exists()
    assert not (fresh_repo / "data/metrics/prepare_data.json").exists()
