"""Where records come from, by params: a local jsonl, json, parquet or csv file, a directory of
them, an image folder with a metadata file, a MathVista-schema directory, or a hub id with config
and split (`datasets.load_dataset` faked: nothing is downloaded). Bad lines are reported with file
and line and skipped, or stop the stage with one line under `data.strict`; and a local data file
is a DVC dependency of prepare_data."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import dvc_repro, make_project_repo, run, stage_command
from PIL import Image

from vlmrl.data import sources
from vlmrl.data.prepare import DataError, load_raw_records, prepare, render_report
from vlmrl.params import DataParams, ParamsError

ROWS = [{"id": f"r{i}", "question": f"What is {i} times 3?", "answer": str(3 * i)}
        for i in range(1, 6)]


def local(path: Path, **values) -> DataParams:
    return DataParams(**{"source": "local", "path": str(path), "eval_size": 1, **values})


def answers(settings: DataParams) -> dict[str, str]:
    prepared = prepare(load_raw_records(settings), settings)
    return {row["pid"]: row["answer"] for row in prepared.train + prepared.eval}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_parquet(path: Path, rows: list[dict]) -> None:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)


WRITERS = {"jsonl": write_jsonl, "csv": write_csv, "parquet": write_parquet,
           "json": lambda path, rows: path.write_text(json.dumps(rows), encoding="utf-8")}
EXPECTED = {row["id"]: row["answer"] for row in ROWS}


@pytest.mark.parametrize("suffix", sorted(WRITERS))
def test_each_local_format(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"records.{suffix}"
    WRITERS[suffix](path, ROWS)
    assert answers(local(path, columns={"id": "id"})) == EXPECTED


def test_a_directory_reads_every_record_file(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    write_csv(tmp_path / "b.csv", ROWS[2:])
    (tmp_path / "notes.txt").write_text("not records")
    assert answers(local(tmp_path, columns={"id": "id"})) == EXPECTED


def test_csv_cells_hold_choices_as_json(tmp_path: Path) -> None:
    rows = [{"id": f"c{i}", "question": "Pick one", "answer": "b", "choices": '["a", "b"]',
             "precision": ""} for i in range(3)]
    write_csv(tmp_path / "mc.csv", rows)
    settings = local(tmp_path / "mc.csv", columns={"id": "id"}, question_types=("multi_choice",),
                     answer_types=("text",))
    prepared = prepare(load_raw_records(settings), settings)
    assert prepared.train[0]["choices"] == ["a", "b"]


@pytest.mark.parametrize("metadata", ["metadata.jsonl", "metadata.csv"])
def test_image_folder_with_a_metadata_file(tmp_path: Path, metadata: str) -> None:
    (tmp_path / "images").mkdir()
    rows = []
    for i, colour in enumerate(("red", "green", "blue")):
        Image.new("RGB", (64, 32), colour).save(tmp_path / "images" / f"{colour}.png")
        rows.append({"file_name": f"images/{colour}.png", "question": "How many bars?",
                     "answer": str(i)})
    WRITERS[metadata.rsplit(".", 1)[1]](tmp_path / metadata, rows)
    settings = local(tmp_path, image_size=32)
    prepared = prepare(load_raw_records(settings), settings)
    records = prepared.train + prepared.eval
    assert len(records) == 3 and len({r["pid"] for r in records}) == 3
    assert all(r["image"].size == (32, 16) for r in records)
    assert {r["image"].getpixel((0, 0)) for r in records} == {(255, 0, 0), (0, 128, 0),
                                                              (0, 0, 255)}
    assert [p["type"] for p in records[0]["prompt"][1]["content"]] == ["image", "text"]


def test_image_folder_row_without_a_file_is_a_bad_line(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    write_jsonl(tmp_path / "metadata.jsonl", [
        {"file_name": "a.png", "question": "q", "answer": "1"},
        {"file_name": "", "question": "q2", "answer": "2"},
        {"file_name": "gone.png", "question": "q3", "answer": "3"},
        {"file_name": "a.png", "question": "q4", "answer": "4"}])
    prepared = prepare(load_raw_records(local(tmp_path)), local(tmp_path))
    reasons = {s.where.rsplit("/", 1)[1]: s.reason for s in prepared.skipped}
    assert reasons == {"metadata.jsonl:2": "no file_name (the image's path)",
                       "metadata.jsonl:3": f"image file not found: {tmp_path / 'gone.png'}"}


def test_mathvista_schema_directory_keeps_working(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    rows = {}
    for pid in ("1", "2", "3"):
        Image.new("RGB", (40, 40), "white").save(tmp_path / "images" / f"{pid}.jpg")
        rows[pid] = {"pid": pid, "question": "What is x?", "image": f"images/{pid}.jpg",
                     "answer": pid, "question_type": "free_form", "answer_type": "integer",
                     "choices": None, "precision": None, "unit": None,
                     "metadata": {"source": "Geometry3K", "context": "geometry diagram"}}
    (tmp_path / "testmini.json").write_text(json.dumps(rows))
    settings = local(tmp_path, image_size=28)
    prepared = prepare(load_raw_records(settings), settings)
    records = prepared.train + prepared.eval
    assert sorted(r["pid"] for r in records) == ["1", "2", "3"]
    assert {(r["source"], r["category"]) for r in records} == {("Geometry3K", "geometry diagram")}
    assert records[0]["image"].size == (28, 28)


def test_a_path_in_data_source_must_be_data_path(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data.jsonl", ROWS)
    same = DataParams(source=str(tmp_path / "data.jsonl"), path=str(tmp_path / "data.jsonl"),
                      eval_size=1)
    assert len(answers(same)) == 5
    other = DataParams(source=str(tmp_path / "data.jsonl"), eval_size=1)
    with pytest.raises(ParamsError, match="set data.source: local and data.path: "):
        list(load_raw_records(other))
    with pytest.raises(ParamsError, match="data.path.*no such file"):
        list(load_raw_records(local(tmp_path / "missing.jsonl")))


BAD_JSONL = "\n".join([json.dumps(ROWS[0]), '{"question": "cut off', json.dumps(ROWS[1]),
                       "[1, 2]", "", json.dumps(ROWS[2]), json.dumps(ROWS[3])]) + "\n"


def test_bad_lines_are_skipped_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(BAD_JSONL)
    (tmp_path / "more.csv").write_text("question,answer\nWhat is 2+2?,4\nonly one field\n"
                                       'a,"1",extra\nWhat is 3+3?,6\n')
    settings = local(tmp_path)
    prepared = prepare(load_raw_records(settings), settings)
    skipped = {s.where: s.reason for s in prepared.skipped}
    assert skipped == {
        f"{path}:2": "not valid JSON (Unterminated string starting at: column 14)",
        f"{path}:4": "expected a JSON object, got list",
        f"{tmp_path / 'more.csv'}:3": "expected 2 fields as in the header, got 1",
        f"{tmp_path / 'more.csv'}:4": "expected 2 fields as in the header, got 3"}
    assert len(prepared.train) + len(prepared.eval) == 6
    report = render_report(prepared, settings)
    assert f"| - | {path}:4 | expected a JSON object, got list |" in report


def test_strict_stops_at_the_first_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(BAD_JSONL)
    settings = local(path, strict=True)
    with pytest.raises(DataError, match=f"^{path}:2: not valid JSON .*data.strict is true"):
        prepare(load_raw_records(settings), settings)


@pytest.mark.parametrize("strict", [False, True])
def test_stage_reports_bad_lines_without_a_traceback(tmp_path: Path, strict: bool) -> None:
    from project_repo import copy_project, update_params

    project = copy_project(tmp_path / "project")
    (project / "data/local/train.jsonl").write_text(BAD_JSONL)
    update_params(project, {"data.source": "local", "data.path": "data/local/train.jsonl",
                            "data.eval_size": 1, "data.strict": strict})
    result = run(stage_command("prepare_data", project), project, check=False)
    assert "Traceback" not in result.stderr
    if strict:
        assert result.returncode == 1
        assert result.stderr.strip() == ("prepare_data failed: data/local/train.jsonl:2: not valid "
                                         "JSON (Unterminated string starting at: column 14) "
                                         "(data.strict is true)")
    else:
        assert result.returncode == 0, result.stderr
        report = (project / "data/reports/data_report.md").read_text()
        assert "| - | data/local/train.jsonl:4 | expected a JSON object, got list |" in report


class FakeLoadDataset:
    """Stands in for `datasets.load_dataset`; records how it was called."""

    def __init__(self, rows: list[dict] | Exception) -> None:
        self.rows, self.calls = rows, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if isinstance(self.rows, Exception):
            raise self.rows
        return self.rows


def test_hub_dataset_by_id_config_and_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "check_hub_dataset", lambda *args: None)  # tests/test_hub.py
    import datasets

    fake = FakeLoadDataset([{"question": f"How many? {i}", "answer": f"Work.\n#### {i}"}
                            for i in range(4)])
    monkeypatch.setattr(datasets, "load_dataset", fake)
    settings = DataParams(source="openai/gsm8k", config="main", split="train", eval_size=1,
                          answer_pattern="after_hashes")
    assert sorted(answers(settings).values()) == ["0", "1", "2", "3"]
    assert fake.calls == [(("openai/gsm8k",), {"name": "main", "split": "train",
                                               "revision": None})]


def test_hub_failure_is_one_error_naming_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "check_hub_dataset", lambda *args: None)  # tests/test_hub.py
    import datasets

    monkeypatch.setattr(datasets, "load_dataset",
                        FakeLoadDataset(ConnectionError("hub unreachable")))
    settings = DataParams(source="openai/gsm8k", config="main", split="train")
    with pytest.raises(DataError, match=r"'openai/gsm8k' \(config 'main', split 'train'\) could "
                                        r"not be loaded: ConnectionError: hub unreachable"):
        list(load_raw_records(settings))


@pytest.mark.slow
def test_local_data_is_a_dvc_dependency_of_prepare_data(tmp_path: Path) -> None:
    repo = make_project_repo(tmp_path / "repo", {
        "data.source": "local", "data.path": "data/local/train.jsonl", "data.eval_size": 1,
        "data.columns": {"id": "id"}})
    write_jsonl(repo / "data/local/train.jsonl", ROWS)
    run(["git", "add", "data/local/train.jsonl"], repo)
    run(["git", "commit", "-qm", "data"], repo)
    assert "Running stage 'prepare_data'" in dvc_repro(repo, "prepare_data").stdout
    assert "didn't change" in dvc_repro(repo, "prepare_data").stdout

    edited = [*ROWS[:-1], {**ROWS[-1], "answer": "16"}]
    write_jsonl(repo / "data/local/train.jsonl", edited)
    status = run(["dvc", "status", "prepare_data"], repo).stdout
    assert "modified:" in status and "data/local/train.jsonl" in status
    assert "Running stage 'prepare_data'" in dvc_repro(repo, "prepare_data").stdout
    from datasets import load_from_disk

    prepared = [load_from_disk(str(repo / "data/prepared" / name)) for name in ("train", "eval")]
    assert {pid: answer for split in prepared
            for pid, answer in zip(split["pid"], split["answer"], strict=True)}["r5"] == "16"
