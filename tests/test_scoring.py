"""Tests for vlmrl.rewards.scoring: literal rules first, then every real MathVista testmini record."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import pytest

from vlmrl.rewards.scoring import (
    MAX_ANSWER_CHARS,
    Score,
    extract_solution,
    format_ok,
    gold_parseable,
    levenshtein,
    parse_number,
    score,
)

TESTMINI = Path(__file__).resolve().parents[1].parent / "shared" / "mathvista" / "testmini.json"


def wrap(answer: str) -> str:
    return f"<REASONING>Looking at the figure.</REASONING>\n<SOLUTION>{answer}</SOLUTION>"


def free(
    answer: str,
    answer_type: str = "integer",
    precision: float | None = None,
    unit: str | None = None,
) -> dict:
    return {
        "answer": answer,
        "question_type": "free_form",
        "answer_type": answer_type,
        "choices": None,
        "precision": precision,
        "unit": unit,
    }


def mc(answer: str, choices: list[str]) -> dict:
    return {
        "answer": answer,
        "question_type": "multi_choice",
        "answer_type": "text",
        "choices": choices,
        "precision": None,
        "unit": None,
    }


def correct(answer: str, record: dict) -> bool:
    return score(wrap(answer), record).correct


# ----------------------------------------------------------------- extraction


def test_extract_solution_takes_last_block_stripped() -> None:
    text = "<SOLUTION> 1 </SOLUTION> then <SOLUTION>\n 2 \n</SOLUTION> tail"
    assert extract_solution(text) == "2"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "no tags at all",
        "<SOLUTION>unclosed",
        "closed only</SOLUTION>",
        "</SOLUTION><SOLUTION>reversed",
    ],
)
def test_extract_solution_none_without_a_block(text: str) -> None:
    assert extract_solution(text) is None


def test_extract_solution_keeps_empty_block() -> None:
    assert extract_solution("<SOLUTION>   </SOLUTION>") == ""


def test_format_ok_rules() -> None:
    assert format_ok("<REASONING>r</REASONING><SOLUTION>s</SOLUTION>")
    assert not format_ok("<SOLUTION>s</SOLUTION><REASONING>r</REASONING>")  # wrong order
    assert not format_ok("<REASONING>r</REASONING><SOLUTION>1</SOLUTION><SOLUTION>2</SOLUTION>")
    assert not format_ok("<REASONING>r<SOLUTION>s</SOLUTION></REASONING>")  # nested
    assert not format_ok("<SOLUTION>s</SOLUTION>")
    assert not format_ok("")


def test_no_solution_block_is_wrong_even_with_the_answer_in_text() -> None:
    result = score("<REASONING>The answer is 12.</REASONING> 12", free("12"))
    assert result == Score(
        correct=False, extracted=None, normalized=None, gold="12", format_ok=False
    )


def test_huge_garbage_is_fast_and_wrong() -> None:
    rng = random.Random(0)
    garbage = "".join(chr(rng.randrange(0, 0x2FFF)) for _ in range(200_000)) * 25  # 5 M characters
    unclosed = "<SOLUTION>" * 500_000  # quadratic for a naive lazy regex
    huge_answer = "<SOLUTION>" + "9" * 5_000_000 + "</SOLUTION>"
    start = time.perf_counter()
    for text in (garbage, unclosed, huge_answer, garbage + wrap("12")[:-1]):
        assert not score(text, free("12")).correct
    assert time.perf_counter() - start < 2.0
    assert score(huge_answer, free("12")).normalized is None


def test_binary_garbage_is_wrong_and_does_not_crash() -> None:
    blob = bytes(random.Random(1).randrange(256) for _ in range(10_000))
    for text in (
        blob.decode("latin-1"),
        blob.decode("utf-8", errors="surrogateescape"),
        "\x00" * 100,
    ):
        assert not score(text, mc("B", ["A", "B"])).correct
        assert not score(wrap(text), free("1.5", "float", 1)).correct


def test_answer_longer_than_the_cap_is_wrong() -> None:
    assert correct("1 apples", free("1"))
    assert not correct("1" + " apples" * (MAX_ANSWER_CHARS // 7 + 1), free("1"))


# --------------------------------------------------------------- tolerances


@pytest.mark.parametrize(
    ("response", "record"),
    [
        ("30", free("30.0", "float", 1)),
        ("30.0", free("30")),
        ("30.000", free("30")),
        ("2.9999999", free("3")),  # float within tolerance of the integer
        ("12 cm", free("12")),
        ("5 years", free("5", unit="years")),
        ("5years", free("5", unit="years")),
        ("7 g", free("7", unit="g")),
        ("12 m3", free("12", unit="m3")),
        ("1.2 m/s^2", free("1.2", "float", 1)),
        ("45°", free("45")),
        ("45^{\\circ}", free("45")),
        ("1,000", free("1000")),
        ("1,234,567.5", free("1234567.5", "float", 1)),
        ("\\boxed{12}", free("12")),
        ("So \\boxed{\\frac{3}{4}}", free("0.75", "float", 2)),
        ("\\boxed{\\text{12}}", free("12")),
        ("$12$", free("12")),
        ("\\(12\\)", free("12")),
        ("3/4", free("0.75", "float", 2)),
        ("-\\dfrac{1}{2}", free("-0.5", "float", 1)),
        ("45%", free("45")),
        ("45\\%", free("45")),
        ("Answer: 12", free("12")),
        ("The final answer is 12.", free("12")),
        ("x = 12", free("12")),
        ("d = 1.2 m", free("1.2", "float", 1)),
        ("about 12", free("12")),
        ("$30", free("30")),
        ("−4.3", free("-4.3", "float", 1)),
        ("-0.0", free("0.0", "float", 1)),
        ("**12**", free("12")),
        ("[1,2]", free("[1, 2]", "list")),
        ("[1, 2.0]", free("[1, 2]", "list")),
        ("(2014, 2016)", free("[2014, 2016]", "list")),
        ("2014, 2016", free("[2014, 2016]", "list")),
        ("Stay the same.", mc("stay the same ", ["increase", "stay the same "])),
        ("145", mc("145°", ["35°", "145°", "55°"])),
        ("6.0", mc("6", ["6.5", "6", "5.5"])),
    ],
)
def test_tolerant_like_a_human_grader(response: str, record: dict) -> None:
    assert correct(response, record), score(wrap(response), record)


@pytest.mark.parametrize(
    ("response", "record"),
    [
        ("31", free("30.0", "float", 1)),
        ("13", free("12")),
        ("12 or 13", free("12")),
        ("2+2", free("4")),  # never evaluated
        ("__import__('os').getcwd()", free("4")),
        ("nan", free("1.5", "float", 1)),
        ("inf", free("1.5", "float", 1)),
        ("1e400", free("1")),
        ("4/0", free("4")),
        ("1,2", free("12")),
        ("", free("12")),
        ("4.5%", free("45")),
        ("[2, 1]", free("[1, 2]", "list")),
        ("[1, 2, 3]", free("[1, 2]", "list")),
        ("", mc("B", ["A", "B"])),
        ("12 cm", mc("12 m", ["12 cm", "12 m"])),
        ("12.0", mc("12 cm", ["12 cm", "12 m"])),  # a number matching two choices picks neither
        ("12 m3", free("12")),  # a digit in the tail is not a unit unless it is the record's
    ],
)
def test_wrong_answers_stay_wrong(response: str, record: dict) -> None:
    assert not correct(response, record), score(wrap(response), record)


def test_integer_answers_use_the_official_truncation() -> None:
    assert score(wrap("2.7"), free("2")).normalized == "2"
    assert correct("2.7", free("2"))
    assert not correct("2.7", free("3"))


def test_float_answers_round_to_the_record_precision() -> None:
    record = free("1.45", "float", 2)
    assert correct("1.4500", record)
    assert correct("1.449", record)
    assert not correct("1.46", record)
    assert not correct("1.4", record)


@pytest.mark.parametrize("precision", [None, float("nan"), "", "x"])
def test_float_precision_missing_is_inferred_from_the_gold(precision: object) -> None:
    record = free("1.45", "float", precision)  # type: ignore[arg-type]
    assert correct("1.450", record)
    assert not correct("1.5", record)


def test_float_precision_may_be_a_float() -> None:
    assert correct("2.54", free("2.5", "float", 1.0))


def test_multiple_choice_letters_and_nearest_choice() -> None:
    record = mc("banana split", ["apple pie", "banana split", "cherry tart"])
    for response in (
        "B",
        "(B)",
        "B.",
        "b)",
        "B: banana split",
        "(B) banana split",
        "Option B",
        "The answer is (B).",
    ):
        assert correct(response, record), response
    assert not correct("C", record)
    assert not correct("(a)", record)
    assert correct("banana splt", record)  # nearest choice by edit distance
    assert not correct("chery tart", record)
    assert not correct("Z", record)  # out of range: nearest choice by edit distance is not B


def test_choice_text_beats_the_letter_reading() -> None:
    record = mc("B", ["C", "B", "A"])  # choices that are themselves letters
    assert correct("B", record)
    assert not correct("A", record)
    assert correct("(B)", mc("b", ["a", "b"]))


def test_letter_choices_in_shuffled_order() -> None:
    record = mc("(b)", ["(c)", "(d)", "(a)", "(b)", "(e)"])  # MathVista pid 849
    assert correct("(b)", record)  # the choice text itself
    assert correct("(D)", record)  # option D
    assert not correct("(B)", record)  # option B is "(d)"
    assert not correct("(e)", record)


def test_gold_given_as_a_letter_maps_to_its_choice() -> None:
    assert correct("dog", mc("B", ["cat", "dog"]))


@pytest.mark.parametrize(
    "record",
    [
        free("abc"),
        free("2.5"),
        free("", "float", 1),
        free("n/a", "float", 1),
        free("abc", "list"),
        free("1", "unknown_type"),
        mc("A", []),
        mc("A", None),  # type: ignore[arg-type]
        {"answer": None, "question_type": "free_form", "answer_type": "integer"},
    ],
)
def test_unparseable_gold(record: dict) -> None:
    assert not gold_parseable(record)
    assert not score(wrap(str(record.get("answer"))), record).correct


def test_parse_number_rejects_non_numbers() -> None:
    assert parse_number("12 cm") == 12.0
    assert parse_number("1.5e3") == 1500.0
    for text in ("twelve", "12-13", "3:30", "nan", "1,2", "(0, 0)"):
        assert parse_number(text) is None, text


def test_levenshtein() -> None:
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("sitting", "kitten") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("same", "same") == 0


# ------------------------------------------------------------ real records


@pytest.fixture(scope="module")
def records() -> list[dict]:
    if not TESTMINI.exists():
        pytest.skip(f"MathVista testmini annotations not found at {TESTMINI}")
    data = json.loads(TESTMINI.read_text(encoding="utf-8"))
    rows = list(data.values()) if isinstance(data, dict) else list(data)
    assert len(rows) == 1000
    return rows


def _wrong_answer(record: dict) -> str:
    gold = record["answer"]
    if record["question_type"] == "multi_choice":
        return next(c for c in record["choices"] if c.strip() != gold.strip())
    if record["answer_type"] == "integer":
        return str(int(gold) + 1)
    if record["answer_type"] == "float":
        return str(round(float(gold) + 1, int(record["precision"])))
    return gold[:-1] + ", 99]"


def _failures(records: list[dict], answer, expect: bool) -> list[tuple[str, str]]:
    failed = []
    for record in records:
        response = answer(record)
        if score(wrap(response), record).correct is not expect:
            failed.append((record["pid"], response))
    return failed


def test_every_gold_answer_scores_correct(records: list[dict]) -> None:
    assert all(gold_parseable(r) for r in records)
    assert _failures(records, lambda r: r["answer"], True) == []


def test_every_wrong_answer_scores_wrong(records: list[dict]) -> None:
    assert _failures(records, _wrong_answer, False) == []


def _letter(record: dict, index: int) -> str:
    return chr(ord("A") + index)


def test_every_multiple_choice_letter(records: list[dict]) -> None:
    choice_records = [r for r in records if r["question_type"] == "multi_choice"]
    assert len(choice_records) == 540

    def right(record: dict) -> str:
        return f"({_letter(record, record['choices'].index(record['answer']))})"

    def wrong(record: dict) -> str:
        choices = record["choices"]
        return _letter(record, next(i for i, c in enumerate(choices) if c != record["answer"]))

    assert _failures(choice_records, right, True) == []
    assert _failures(choice_records, lambda r: right(r)[1] + ".", True) == []
    assert _failures(choice_records, wrong, False) == []


def test_every_float_record_at_its_precision(records: list[dict]) -> None:
    float_records = [r for r in records if r["answer_type"] == "float"]
    assert len(float_records) == 40

    def padded(record: dict) -> str:
        return record["answer"] + "00"

    def off_by_one_step(record: dict) -> str:
        step = 10 ** -int(record["precision"])
        return f"{float(record['answer']) + step:.{int(record['precision']) + 2}f}"

    assert _failures(float_records, padded, True) == []
    assert _failures(float_records, off_by_one_step, False) == []


def test_unit_records_accept_the_unit(records: list[dict]) -> None:
    with_unit = [r for r in records if r["unit"]]
    assert len(with_unit) == 50
    assert _failures(with_unit, lambda r: f"{r['answer']} {r['unit']}", True) == []


def test_scoring_all_records_is_fast(records: list[dict]) -> None:
    responses = [wrap(r["answer"]) for r in records]
    start = time.perf_counter()
    for response, record in zip(responses, records, strict=True):
        score(response, record)
    assert time.perf_counter() - start < 2.0


def test_score_is_not_fooled_by_nan_precision(records: list[dict]) -> None:
    record = dict(next(r for r in records if r["answer_type"] == "integer"), precision=math.nan)
    assert score(wrap(record["answer"]), record).correct
