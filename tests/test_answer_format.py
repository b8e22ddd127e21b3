"""One answer format (tags, system prompt, format bonus) from params.yaml, read by the prompts,
the SFT targets, the scorer, the rewards, the playground and the model card."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vlmrl.params import ParamsError
from vlmrl.rewards.answer_format import (
    DEFAULT_FORMAT,
    AnswerFormat,
    AnswerFormatParams,
    answer_format,
)
from vlmrl.rewards.functions import build_rewards, score_completion
from vlmrl.rewards.scoring import extract_solution, format_ok, score
from vlmrl.training.sft import sft_completion

GSM8K = {"reasoning_tags": ["<THINK>", "</THINK>"], "solution_tags": ["<SOLUTION>", "</SOLUTION>"],
         "format_bonus": 0.5,
         "system_prompt": "Think between {reasoning_open} and {reasoning_close}; answer between "
                          "{solution_open} and {solution_close}."}
THINK = answer_format({"answer_format": GSM8K})
RECORD = {"answer": "72", "question_type": "free_form", "answer_type": "integer", "choices": None,
          "precision": None, "unit": None}


def test_defaults_are_the_mathvista_format_and_its_old_prompt() -> None:
    assert answer_format({}) == DEFAULT_FORMAT
    assert DEFAULT_FORMAT.system_text() == (
        "You are a careful visual maths solver. Look at the image and think step by step. "
        "Write your reasoning between <REASONING> and </REASONING>, then give only the final "
        "answer between <SOLUTION> and </SOLUTION>.")
    shipped = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    assert answer_format(shipped) == DEFAULT_FORMAT


def test_params_section_fills_the_prompt_with_its_tags() -> None:
    assert THINK == AnswerFormat("<THINK>", "</THINK>", "<SOLUTION>", "</SOLUTION>",
                                 GSM8K["system_prompt"], 0.5)
    assert THINK.system_text() == "Think between <THINK> and </THINK>; answer between " \
                                  "<SOLUTION> and </SOLUTION>."


@pytest.mark.parametrize("change,message", [
    ({"reasoning_tags": ["<T>"]}, "answer_format.reasoning_tags: must be a pair"),
    ({"reasoning_tags": ["<T>", "<T>"]}, "must differ"),
    ({"solution_tags": ["<S>", ""]}, "non-empty"),
    ({"solution_tags": ["<THINK>", "</THINK>"]}, "tags must all differ"),
    ({"system_prompt": "answer in {answer_tag}"}, "unknown placeholder"),
    ({"system_prompt": "a lone { brace"}, "not a valid template"),
    ({"format_bonus": "high"}, "answer_format.format_bonus"),
    ({"tags": []}, r"answer_format has unknown keys \[.tags.\]"),
])
def test_bad_answer_format_is_one_line_naming_the_key(change, message) -> None:
    with pytest.raises(ParamsError, match=message):
        AnswerFormatParams.from_params({**GSM8K, **change})


def test_scorer_reads_the_runs_tags() -> None:
    text = "<THINK>8 x 9 = 72</THINK><SOLUTION>72</SOLUTION>"
    assert extract_solution(text, THINK) == "72" and format_ok(text, THINK)
    assert not format_ok(text) and score(text, RECORD, THINK).correct
    assert score("<REASONING>x</REASONING><SOLUTION>72</SOLUTION>", RECORD, THINK).format_ok is False


def test_rewards_get_the_format_and_its_bonus() -> None:
    funcs, _ = build_rewards({"format_reward": 1.0, "correctness_reward": 1.0}, answer_format=THINK)
    good, default_tags = "<THINK>r</THINK><SOLUTION>72</SOLUTION>", "<REASONING>r</REASONING>"
    assert funcs[0]([good, default_tags], **{k: [v, v] for k, v in RECORD.items()}) == [1.0, 0.0]
    assert funcs[1]([good], **{k: [v] for k, v in RECORD.items()}) == [2.0]
    scored = score_completion(good, RECORD, {"format_reward": 1.0}, answer_format=THINK)
    assert scored["rewards"]["format_reward"] == 1.0 and scored["format_ok"] is True
    with pytest.raises(ValueError, match="answer_format section"):
        build_rewards({"format_reward": 1.0}, {"format_reward": {"answer_format": THINK}})


def test_sft_targets_are_written_in_the_runs_format() -> None:
    assert sft_completion("72", "I multiply.", THINK) == \
        "<THINK>I multiply.</THINK><SOLUTION>72</SOLUTION>"
    assert format_ok(sft_completion("72", "I multiply.", THINK), THINK)


def test_playground_and_model_card_show_the_runs_format(tmp_path) -> None:
    from conftest import ROOT
    from starlette.testclient import TestClient

    from vlmrl.publish.model_card import _answer_format_section
    from vlmrl.ui.app import create_app

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["answer_format"] = GSM8K
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    client = TestClient(create_app(tmp_path), base_url="http://127.0.0.1")
    config = client.get("/api/config").json()
    assert config["tags"]["reasoning_open"] == "<THINK>"
    assert config["example"]["completion"].startswith("<THINK>")
    scored = client.post("/api/score", json={"completion": config["example"]["completion"],
                                             "record": config["example"]["record"]}).json()
    assert scored["rewards"]["format_reward"] == 1.0  # two blocks at the 0.5 bonus
    card = "\n".join(_answer_format_section(params))
    assert "Think between <THINK> and </THINK>" in card
