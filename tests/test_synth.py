"""Tests for vlmrl.data.synth: determinism, MathVista's schema, and answers recomputed from the drawn data."""

from __future__ import annotations

import io
import json
import math
import statistics
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlmrl.data import synth
from vlmrl.rewards.scoring import gold_parseable, score

TESTMINI = Path(__file__).resolve().parents[1].parent / "shared" / "mathvista" / "testmini.json"
SIZE = 256


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return synth.generate(120, seed=7, image_size=SIZE)


@pytest.fixture(scope="module")
def many_small() -> list[dict]:
    """Enough records to reach every template; tiny images keep it fast."""
    return synth.generate(400, seed=21, image_size=64)


@pytest.fixture(scope="module")
def testmini() -> list[dict]:
    if not TESTMINI.exists():
        pytest.skip(f"MathVista testmini annotations not found at {TESTMINI}")
    return list(json.loads(TESTMINI.read_text(encoding="utf-8")).values())


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def without_image(record: dict) -> dict:
    return {key: value for key, value in record.items() if key != "image"}


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"n": 0}, "n"), ({"n": -3}, "n"), ({"n": 2, "image_size": 63}, "image_size")],
)
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} "):
        synth.generate(**kwargs)


# -------------------------------------------------------------- determinism


def test_same_seed_gives_identical_records_and_png_bytes() -> None:
    first, second = (
        synth.generate(8, seed=3, image_size=SIZE),
        synth.generate(8, seed=3, image_size=SIZE),
    )
    assert [without_image(r) for r in first] == [without_image(r) for r in second]
    assert [png_bytes(r["image"]) for r in first] == [png_bytes(r["image"]) for r in second]


def test_different_seeds_differ() -> None:
    first, second = (
        synth.generate(8, seed=1, image_size=SIZE),
        synth.generate(8, seed=2, image_size=SIZE),
    )
    assert [r["question"] for r in first] != [r["question"] for r in second]
    assert sum(a["image"].tobytes() != b["image"].tobytes() for a, b in zip(first, second)) >= 6


def test_record_i_does_not_depend_on_n() -> None:
    short, long = (
        synth.generate(5, seed=11, image_size=SIZE),
        synth.generate(10, seed=11, image_size=SIZE),
    )
    assert [without_image(r) for r in long[:5]] == [without_image(r) for r in short]
    assert [r["image"].tobytes() for r in long[:5]] == [r["image"].tobytes() for r in short]


def test_image_is_drawn_from_the_stored_data_alone(records: list[dict]) -> None:
    for record in records[:24]:
        assert (
            synth.render(record["metadata"]["synth"], SIZE).tobytes() == record["image"].tobytes()
        )


# -------------------------------------------------------------------- schema


def test_keys_match_mathvista_plus_query(records: list[dict], testmini: list[dict]) -> None:
    mathvista_keys = {frozenset(r) for r in testmini}
    mathvista_metadata_keys = {frozenset(r["metadata"]) for r in testmini}
    assert len(mathvista_keys) == len(mathvista_metadata_keys) == 1
    for record in records:
        assert set(record) == set(next(iter(mathvista_keys))) | {"query"}
        assert set(record["metadata"]) == set(next(iter(mathvista_metadata_keys))) | {"synth"}


def test_field_types_and_values(records: list[dict]) -> None:
    for index, record in enumerate(records):
        assert record["pid"] == f"synth-{index:05d}"
        assert isinstance(record["question"], str) and record["question"].endswith((".", "?", ")"))
        image = record["image"]
        assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (SIZE, SIZE)
        assert isinstance(record["answer"], str) and record["answer"]
        assert record["unit"] is None or (isinstance(record["unit"], str) and record["unit"])
        if record["question_type"] == "multi_choice":
            assert record["answer_type"] == "text" and record["precision"] is None
        else:
            assert record["question_type"] == "free_form" and record["choices"] is None
            assert record["answer_type"] in ("integer", "float")
        if record["answer_type"] == "float":
            assert record["precision"] in (1.0, 2.0) and isinstance(record["precision"], float)
        else:
            assert record["precision"] is None
        metadata = record["metadata"]
        kind = metadata["synth"]["kind"]
        assert metadata["source"] == f"vlmrl-synth-{kind}"
        assert metadata["split"] == "synthetic" and metadata["language"] == "english"
        assert metadata["category"] == "math-targeted-vqa"
        assert metadata["img_width"] == metadata["img_height"] == SIZE
        assert (
            metadata["context"]
            == {
                "bar": "bar chart",
                "line": "line plot",
                "table": "table",
                "geometry": "geometry diagram",
            }[kind]
        )
        assert isinstance(metadata["task"], str) and isinstance(metadata["grade"], str)
        assert metadata["skills"] and all(isinstance(skill, str) for skill in metadata["skills"])
        json.dumps(without_image(record))


def mathvista_query(record: dict) -> str:
    """MathVista's build_query.py for zero-shot solutions, written out again."""
    if record["question_type"] == "multi_choice":
        hint = "Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end."
    elif record["answer_type"] == "integer":
        hint = (
            "Hint: Please answer the question requiring an integer answer and provide the final value, "
            "e.g., 1, 2, 3, at the end."
        )
    elif record["precision"] == 1:
        hint = (
            "Hint: Please answer the question requiring a floating-point number with one decimal place and "
            "provide the final value, e.g., 1.2, 1.3, 1.4, at the end."
        )
    else:
        hint = (
            "Hint: Please answer the question requiring a floating-point number with two decimal places and "
            "provide the final value, e.g., 1.23, 1.34, 1.45, at the end."
        )
    question = f"Question: {record['question']}" + (
        f" (Unit: {record['unit']})" if record["unit"] else ""
    )
    choices = ""
    if record["choices"]:
        choices = "\n".join(
            ["Choices:"] + [f"({'ABCD'[i]}) {c}" for i, c in enumerate(record["choices"])]
        )
    return "\n".join(part for part in (hint, question, choices) if part)


def test_query_is_mathvistas(records: list[dict]) -> None:
    for record in records:
        assert record["query"] == mathvista_query(record)


# ------------------------------------------------------------------- answers


def expected(synth_data: dict) -> float | str:
    """The answer recomputed from the drawn data, without the generator's code."""
    kind, template = synth_data["kind"], synth_data["template"]
    if kind == "bar":
        by_label = dict(zip(synth_data["labels"], synth_data["values"]))
        return expected_from_series(template, by_label, synth_data)
    if kind == "table":
        by_name = dict(zip(synth_data["names"], synth_data["values"]))
        if template == "median":
            return statistics.median(by_name.values())
        if template == "pair_sum":
            return sum(by_name[name] for name in synth_data["operands"])
        return expected_from_series(template, by_name, synth_data)
    if kind == "line":
        by_x = dict(zip(synth_data["x"], synth_data["y"]))
        ys = list(by_x.values())
        if template == "value_at":
            return by_x[synth_data["operands"][0]]
        if template in ("increase", "rate", "mean_span"):
            start, end = synth_data["operands"]
            if template == "mean_span":
                return statistics.mean(by_x[x] for x in range(start, end + 1))
            return (by_x[end] - by_x[start]) / (1 if template == "increase" else end - start)
        if template == "range":
            return max(ys) - min(ys)
        return str(expected_from_series(template, by_x, synth_data))
    return expected_geometry(synth_data)


def expected_from_series(template: str, series: dict, synth_data: dict) -> float | str:
    values = list(series.values())
    if template in ("argmax", "argmin"):
        return (max if template == "argmax" else min)(series, key=series.get)
    operands = [series[label] for label in synth_data.get("operands", [])]
    return {
        "max": lambda: max(values),
        "min": lambda: min(values),
        "total": lambda: sum(values),
        "range": lambda: max(values) - min(values),
        "mean": lambda: statistics.mean(values),
        "sum_pair": lambda: sum(operands),
        "difference_pair": lambda: abs(operands[0] - operands[1]),
        "ratio": lambda: operands[0] / operands[1],
        "count_above": lambda: len([v for v in values if v > synth_data["threshold"]]),
    }[template]()


def expected_geometry(synth_data: dict) -> float:
    shape, template = synth_data["shape"], synth_data["template"]
    if shape == "right_triangle":
        if template == "hypotenuse":
            return math.sqrt(synth_data["vertical"] ** 2 + synth_data["horizontal"] ** 2)
        return math.sqrt(synth_data["hypotenuse"] ** 2 - synth_data["vertical"] ** 2)
    if shape == "rectangle":
        width, height = synth_data["width"], synth_data["height"]
        return width * height if template == "area" else 2 * width + 2 * height
    if shape == "triangle":
        return 180 - sum(synth_data["angles"])
    if shape == "straight_angle":
        return 180 - synth_data["angle"]
    radius = synth_data["radius"]
    return math.pi * radius**2 if template == "area" else 2 * math.pi * radius


def test_answers_match_the_drawn_data(many_small: list[dict]) -> None:
    for record in many_small:
        truth, answer = expected(record["metadata"]["synth"]), record["answer"]
        if record["answer_type"] == "integer":
            assert float(truth) == int(truth) and answer == str(int(truth)), record["pid"]
        elif record["answer_type"] == "float":
            assert abs(float(answer) - truth) <= 0.5 * 10 ** -record["precision"] + 1e-9, record[
                "pid"
            ]
        elif isinstance(truth, str):
            assert answer == truth, record["pid"]
        else:
            assert answer == f"{int(truth)}°", record["pid"]


def test_every_template_is_exercised(many_small: list[dict]) -> None:
    templates = Counter(
        (r["metadata"]["synth"]["kind"], r["metadata"]["synth"]["template"], r["answer_type"])
        for r in many_small
    )
    kinds_by_format = {(kind, answer_type) for kind, _, answer_type in templates}
    assert kinds_by_format == {(k, t) for k in synth.KINDS for t in ("integer", "float", "text")}
    assert len(templates) >= 35


def test_question_names_what_it_asks_about(records: list[dict]) -> None:
    for record in records:
        data = record["metadata"]["synth"]
        for operand in data.get("operands", []):
            assert str(operand) in record["question"]
            assert operand in data.get("labels", data.get("names", data.get("x", [])))
        if "threshold" in data:
            assert f"greater than {data['threshold']}?" in record["question"]


def test_multiple_choice_answer_is_one_of_four_unique_choices(records: list[dict]) -> None:
    multi_choice = [r for r in records if r["question_type"] == "multi_choice"]
    assert multi_choice
    for record in multi_choice:
        assert len(record["choices"]) == len(set(record["choices"])) == 4
        assert record["answer"] in record["choices"]


def test_float_answers_are_written_at_their_precision(records: list[dict]) -> None:
    floats = [r for r in records if r["answer_type"] == "float"]
    assert {r["precision"] for r in floats} == {1.0, 2.0}
    for record in floats:
        precision = int(record["precision"])
        whole, decimals = record["answer"].split(".")
        assert whole.isdigit() and decimals.isdigit() and len(decimals) == precision
        assert str(round(float(record["answer"]), precision)) == record["answer"]


def test_project_scorer_accepts_the_gold_answers(records: list[dict]) -> None:
    for record in records:
        assert gold_parseable(record)
        assert score(
            f"<REASONING>r</REASONING>\n<SOLUTION>{record['answer']}</SOLUTION>", record
        ).correct


def test_format_helper_refuses_ties_and_trailing_zeros() -> None:
    assert synth.format_float(2.25, 2) == "2.25"
    assert synth.format_float(10 / 3, 1) == "3.3"
    assert synth.format_float(2.25, 1) is None
    assert synth.format_float(2.5, 2) is None
    assert synth.format_float(4.0, 1) is None


# ----------------------------------------------------------------- the mix


def test_all_kinds_appear_in_forty() -> None:
    records = synth.generate(40, seed=0, image_size=64)
    assert {r["metadata"]["synth"]["kind"] for r in records} == set(synth.KINDS)


def test_answer_formats_are_spread(many_small: list[dict]) -> None:
    records = many_small
    shares = Counter(r["answer_type"] for r in records)
    assert 0.4 <= shares["integer"] / 400 <= 0.6
    assert 0.12 <= shares["float"] / 400 <= 0.28
    assert 0.2 <= shares["text"] / 400 <= 0.4
    assert Counter(r["metadata"]["synth"]["kind"] for r in records) == {
        kind: 100 for kind in synth.KINDS
    }


def test_images_are_not_blank(records: list[dict]) -> None:
    for record in records:
        pixels = np.asarray(record["image"])
        drawn = (pixels != 255).any(axis=-1)
        assert drawn.mean() > 0.008, record["pid"]
        rows, columns = np.nonzero(drawn)
        spans = sorted((columns.max() - columns.min(), rows.max() - rows.min()))
        assert spans[1] > SIZE / 2 and spans[0] > SIZE / 4, record["pid"]


# ---------------------------------------------------------------------- save


def test_save_writes_pngs_and_matching_jsonl(tmp_path: Path) -> None:
    records = synth.generate(6, seed=9, image_size=SIZE)
    synth.save(records, tmp_path / "set")
    rows = [
        json.loads(line)
        for line in (tmp_path / "set" / "data.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert len(rows) == len(records)
    for row, record in zip(rows, records):
        assert row["image"] == f"images/{record['pid']}.png"
        assert {k: v for k, v in row.items() if k != "image"} == without_image(record)
        with Image.open(tmp_path / "set" / row["image"]) as saved:
            assert (
                saved.format == "PNG"
                and saved.convert("RGB").tobytes() == record["image"].tobytes()
            )


# ------------------------------------------------------------------ read tier


def test_every_regular_kind_names_its_tier(records: list[dict]) -> None:
    expected_tiers = {"bar": "chart", "line": "chart", "table": "chart", "geometry": "geometry"}
    for record in records:
        synth_data = record["metadata"]["synth"]
        assert synth_data["tier"] == expected_tiers[synth_data["kind"]]


def test_read_tier_states_its_digit_and_draws_it() -> None:
    read = synth.generate_read(24, seed=42, image_size=96)
    assert [r["pid"] for r in read] == [f"synth-read-{i:05d}" for i in range(24)]
    for record in read:
        value = record["metadata"]["synth"]["value"]
        assert record["answer"] == str(value) and 1 <= value <= 9
        assert str(value) in record["question"] and record["question"] in record["query"]
        assert (record["question_type"], record["answer_type"]) == ("free_form", "integer")
        assert record["metadata"]["synth"]["tier"] == "read"
        assert record["metadata"]["source"] == "vlmrl-synth-read"
        assert score(f"<SOLUTION>{value}</SOLUTION>", record).correct
        redrawn = synth.render(record["metadata"]["synth"], 96)
        assert redrawn.tobytes() == record["image"].tobytes()
    assert len({r["answer"] for r in read}) > 3


def test_read_tier_is_deterministic_and_apart_from_the_regular_items() -> None:
    first = synth.generate_read(6, seed=5, image_size=64)
    assert [r["question"] for r in first] == [
        r["question"] for r in synth.generate_read(3, seed=5, image_size=64)
    ] + [r["question"] for r in first[3:]]
    assert first[0]["image"].tobytes() == synth.generate_read(1, seed=5, image_size=64)[0][
        "image"].tobytes()
    assert synth.generate_read(0, seed=5, image_size=64) == []
    with pytest.raises(ValueError, match="at least 0"):
        synth.generate_read(-1)
