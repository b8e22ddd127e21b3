"""Tests for vlmrl.rewards.functions: TRL-shaped reward functions, the registry and score_completion."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from vlmrl.params import ParamsError, RewardsParams
from vlmrl.params_checks import BUILTIN_REWARDS
from vlmrl.rewards.functions import (
    MODEL_REWARDS,
    REWARD_FUNCS,
    build_rewards,
    completion_text,
    correctness_reward,
    format_reward,
    length_penalty,
    rouge_reward,
    score_completion,
)

TESTMINI = Path(__file__).resolve().parents[1].parent / "shared" / "mathvista" / "testmini.json"

GOOD = "<REASONING>The bar for 2019 reaches 12 on the axis.</REASONING>\n<SOLUTION>12</SOLUTION>"
INT_RECORD = {
    "answer": "12",
    "question_type": "free_form",
    "answer_type": "integer",
    "choices": None,
    "precision": None,
    "unit": None,
}
MC_RECORD = {
    "answer": "145°",
    "question_type": "multi_choice",
    "answer_type": "text",
    "choices": ["35°", "145°", "55°"],
    "precision": None,
    "unit": None,
}


def columns(*records: dict, **extra: list) -> dict:
    """Dataset columns as TRL passes them: one list per column, plus unrelated ones."""
    cols = {key: [r[key] for r in records] for key in records[0]}
    cols.update(
        pid=[str(i) for i in range(len(records))],
        prompt=["p"] * len(records),
        image=[None] * len(records),
    )
    cols.update(extra)
    return cols


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def solution(answer: str) -> str:
    return f"<REASONING>Some reasoning about the figure.</REASONING><SOLUTION>{answer}</SOLUTION>"


# ---------------------------------------------------------------- completions


def test_completion_text_shapes() -> None:
    assert completion_text("plain") == "plain"
    assert completion_text(chat("hi")) == "hi"
    parts = [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image"},
                {"type": "text", "text": "b"},
            ],
        }
    ]
    assert completion_text(parts) == "ab"
    assert (
        completion_text(
            [{"role": "user", "content": "question"}, {"role": "assistant", "content": "answer"}]
        )
        == "answer"
    )
    assert completion_text([{"role": "assistant", "content": None}]) == ""


# ---------------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD, 2.0),
        ("<SOLUTION>12</SOLUTION>", 1.0),
        ("<REASONING>only thinking</REASONING>", 1.0),
        ("The answer is 12.", 0.0),
        ("", 0.0),
        ("<REASONING>r</REASONING><SOLUTION>1</SOLUTION><SOLUTION>2</SOLUTION>", 1.0),
        ("<REASONING>a</REASONING><REASONING>b</REASONING><SOLUTION>1</SOLUTION>", 1.0),
        ("</SOLUTION>12<SOLUTION>", 0.0),
        ("addCriterion\n" * 100, -2.0),
        (GOOD + "addCriterion" * 40, 0.0),  # both blocks earn 2, degenerate subtracts 2
        ("<SOLUTION>1</SOLUTION>" + "addCriterion" * 40, -1.0),  # one block earns 1
        ("<REASONING>r</REASONING>" + "\n" * 30, -1.0),  # newlines are junk too
        ("\n" * 10 + "x" * 10, -2.0),  # exactly half
        ("\n" * 9 + "x" * 11 + "<SOLUTION>1</SOLUTION>", 1.0),  # under half
    ],
)
def test_format_reward(text: str, expected: float) -> None:
    assert format_reward([text]) == [expected]
    assert format_reward([chat(text)]) == [expected]


def test_format_reward_on_huge_and_binary_text() -> None:
    blob = bytes(random.Random(2).randrange(256) for _ in range(20_000)).decode("latin-1")
    huge = "x" * 5_000_000
    start = time.perf_counter()
    assert format_reward([blob, huge, "addCriterion" * 500_000]) == [0.0, 0.0, -2.0]
    assert time.perf_counter() - start < 2.0


# ----------------------------------------------------------------- correctness


def test_correctness_reward_levels() -> None:
    completions = [
        solution("12"),
        solution("\\boxed{12}"),
        solution("12.0"),
        solution("13"),
        "12",
        "",
    ]
    records = [INT_RECORD] * len(completions)
    assert correctness_reward(completions, **columns(*records)) == [2.0, 1.5, 1.5, 0.0, 0.0, 0.0]


def test_correctness_reward_multiple_choice() -> None:
    completions = [
        chat(solution("145°")),
        chat(solution("(B)")),
        chat(solution("145")),
        chat(solution("C")),
    ]
    assert correctness_reward(completions, **columns(*[MC_RECORD] * 4)) == [2.0, 1.5, 1.5, 0.0]


def test_correctness_reward_none_for_unparseable_gold() -> None:
    bad = dict(INT_RECORD, answer="abc")
    assert correctness_reward([solution("abc"), solution("12")], **columns(bad, INT_RECORD)) == [
        None,
        2.0,
    ]


def test_correctness_reward_ignores_extra_columns_and_trainer_state() -> None:
    cols = columns(INT_RECORD, trainer_state=[object()], completion_ids=[[1, 2]])
    assert correctness_reward([solution("12")], **cols) == [2.0]


def test_correctness_reward_on_garbage() -> None:
    blob = bytes(random.Random(3).randrange(256) for _ in range(20_000)).decode("latin-1")
    garbage = [
        "x" * 5_000_000,
        blob,
        "addCriterion\n" * 1000,
        "<SOLUTION>" + "\x00" * 1000 + "</SOLUTION>",
    ]
    start = time.perf_counter()
    assert correctness_reward(garbage, **columns(*[INT_RECORD] * 4)) == [0.0] * 4
    assert time.perf_counter() - start < 2.0


def test_correctness_reward_column_errors() -> None:
    with pytest.raises(ValueError, match="'answer'"):
        correctness_reward([solution("12")], question_type=["free_form"])
    with pytest.raises(ValueError, match="'unit'"):
        correctness_reward(
            [solution("12"), solution("12")], **columns(INT_RECORD, INT_RECORD, unit=[None])
        )


# ---------------------------------------------------------------------- length


def test_length_penalty_thresholds() -> None:
    texts = ["x" * 49, "x" * 50, "x" * 2000, "x" * 2001, ""]
    assert length_penalty(texts) == [-1.0, 0.0, 0.0, -0.5, -1.0]
    assert length_penalty([chat("x" * 49)]) == [-1.0]
    assert length_penalty(["x" * 5, "x" * 11], min_chars=5, max_chars=10) == [0.0, -0.5]
    with pytest.raises(ValueError, match="min_chars"):
        length_penalty(["x"], min_chars=10, max_chars=5)


# -------------------------------------------------------------------- registry


def test_registry_holds_the_built_in_rewards() -> None:
    assert REWARD_FUNCS == {
        "format_reward": format_reward,
        "correctness_reward": correctness_reward,
        "length_penalty": length_penalty,
        "rouge_reward": rouge_reward,
    }
    assert MODEL_REWARDS == {"bertscore_reward": "vlmrl.models.similarity:bertscore_reward"}


def test_build_rewards_from_weights_and_options() -> None:
    funcs, weights = build_rewards(
        {"format_reward": 0.3, "correctness_reward": 1, "length_penalty": 0.1},
        {"length_penalty": {"min_chars": 5, "max_chars": 10}},
    )
    assert [f.__name__ for f in funcs] == ["format_reward", "correctness_reward", "length_penalty"]
    assert weights == [0.3, 1.0, 0.1]
    assert funcs[0] is format_reward
    assert funcs[2](["x" * 6, "x" * 11]) == [0.0, -0.5]  # the bound options apply


def test_build_rewards_from_params_section() -> None:
    section = {
        "weights": {"format_reward": 0.3, "correctness_reward": 1.0},
        "length_penalty": {"min_chars": 50, "max_chars": 2000},
    }
    rewards = RewardsParams.from_params(section)
    funcs, weights = build_rewards(rewards.weights, rewards.options)
    assert [f.__name__ for f in funcs] == ["format_reward", "correctness_reward"]
    assert weights == [0.3, 1.0]


def test_build_rewards_from_a_list() -> None:
    funcs, weights = build_rewards(["correctness_reward", "format_reward"])
    assert funcs == [correctness_reward, format_reward]
    assert weights == [1.0, 1.0]


def test_unknown_reward_names_the_bad_one_and_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'accuracy_reward'") as error:
        build_rewards({"accuracy_reward": 1.0})
    assert all(name in str(error.value) for name in REWARD_FUNCS)
    with pytest.raises(ValueError, match="'nope'"):
        build_rewards({"format_reward": 1.0}, {"nope": {}})


def test_params_validation_knows_every_built_in_reward() -> None:
    assert set(BUILTIN_REWARDS) == set(REWARD_FUNCS) | set(MODEL_REWARDS)


def test_unknown_reward_fails_params_validation_with_its_key() -> None:
    for section, key in (({"weights": {"bleu": 1.0}}, "rewards.weights"),
                         ({"weights": ["format_reward"], "blue": {"n": 4}}, "rewards")):
        with pytest.raises(ParamsError, match=rf"^params\.yaml {key}: unknown reward 'bl"):
            RewardsParams.from_params(section)
    RewardsParams.from_params({"weights": {"my_rewards:brevity": 1.0}})  # imported later


def test_unknown_option_names_it() -> None:
    with pytest.raises(ValueError, match=r"'max_len'.*'length_penalty'"):
        build_rewards({"length_penalty": 1.0}, {"length_penalty": {"max_len": 10}})
    with pytest.raises(ValueError, match=r"'answer'.*'correctness_reward'"):
        build_rewards({"correctness_reward": 1.0}, {"correctness_reward": {"answer": "1"}})
    with pytest.raises(ValueError, match="'length_penalty'"):
        build_rewards({"length_penalty": 1.0}, {"length_penalty": 5})


@pytest.mark.parametrize("weight", ["high", None, True, float("nan"), [1.0]])
def test_non_numeric_weight_names_the_reward(weight: object) -> None:
    with pytest.raises(ValueError, match="'correctness_reward'"):
        build_rewards({"format_reward": 1.0, "correctness_reward": weight})


# -------------------------------------------------------------- single scoring


def test_score_completion_matches_the_reward_functions() -> None:
    weights = {"format_reward": 0.3, "correctness_reward": 1.0, "length_penalty": 0.5}
    result = score_completion(GOOD, INT_RECORD, weights, {"length_penalty": {"min_chars": 100}})
    assert result["rewards"] == {
        "format_reward": 2.0,
        "correctness_reward": 2.0,
        "length_penalty": -1.0,
    }
    assert result["total"] == pytest.approx(0.3 * 2.0 + 2.0 - 0.5)
    assert (result["extracted"], result["normalized"], result["gold"]) == ("12", "12", "12")
    assert result["correct"] is True and result["format_ok"] is True


def test_score_completion_defaults_and_unparseable_gold() -> None:
    result = score_completion("<SOLUTION>abc</SOLUTION>", dict(INT_RECORD, answer="abc"))
    assert set(result["rewards"]) == set(REWARD_FUNCS)
    assert result["rewards"]["correctness_reward"] is None
    # format 1, length -1, ROUGE 1 (the block equals the gold text), correctness skipped
    assert result["total"] == pytest.approx(1.0 - 1.0 + 1.0)
    assert result["correct"] is False and result["format_ok"] is False


def test_correctness_reward_on_every_real_record() -> None:
    if not TESTMINI.exists():
        pytest.skip(f"MathVista testmini annotations not found at {TESTMINI}")
    data = json.loads(TESTMINI.read_text(encoding="utf-8"))
    records = list(data.values()) if isinstance(data, dict) else list(data)
    keys = (
        "answer",
        "question_type",
        "answer_type",
        "choices",
        "precision",
        "unit",
        "pid",
        "question",
    )
    cols = {key: [r[key] for r in records] for key in keys}
    assert correctness_reward([chat(solution(r["answer"])) for r in records], **cols) == [
        2.0
    ] * len(records)
    assert set(correctness_reward([solution("")] * len(records), **cols)) == {0.0}
