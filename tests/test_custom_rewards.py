"""Rewards given by import path (`package.module:function`), and the metric rewards for free-text
answers (ROUGE, BERTScore-style), through the same registry training and evaluation use."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from vlmrl.rewards.functions import build_rewards, reward_label, rouge_reward, score_completion

BREVITY = '''
def brevity(completions, **columns):
    """1 for a completion of at most `max_words` words."""
    return [1.0 if len(str(c).split()) <= 3 else 0.0 for c in completions]


def with_options(completions, *, bonus=0.5, **columns):
    return [bonus for _ in completions]


def no_columns(completions):
    return [0.0 for _ in completions]


def needs_more(completions, answer, **columns):
    return [0.0 for _ in completions]


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch) -> str:
    """A module in the working directory, as a user's `my_rewards.py` beside params.yaml."""
    name = f"user_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(BREVITY))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def test_import_path_reward_is_built_and_labelled_by_its_function(reward_module) -> None:
    funcs, weights = build_rewards({"format_reward": 1.0, f"{reward_module}:brevity": 0.5})
    assert [f.__name__ for f in funcs] == ["format_reward", "brevity"] and weights == [1.0, 0.5]
    assert funcs[1](["a b", "a b c d"], answer=["1", "2"]) == [1.0, 0.0]
    assert reward_label(f"{reward_module}:brevity") == "brevity"


def test_import_path_reward_takes_options(reward_module) -> None:
    path = f"{reward_module}:with_options"
    funcs, _ = build_rewards({path: 1.0}, {path: {"bonus": 2.0}})
    assert funcs[0].__name__ == "with_options" and funcs[0](["x"]) == [2.0]
    with pytest.raises(ValueError, match="unknown option"):
        build_rewards({path: 1.0}, {path: {"nope": 1}})


@pytest.mark.parametrize("spec,message", [
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("{module}:missing", "has no 'missing'"),
    ("{module}:NOT_A_FUNCTION", "is a int, not a function"),
    ("{module}:no_columns", r"TRL's signature `f\(completions, \*\*columns\)"),
    ("{module}:needs_more", r"TRL's signature"),
    ("{module}:", "an import path is `package.module:function`"),
])
def test_bad_import_path_is_one_clear_error(reward_module, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_rewards({spec.format(module=reward_module): 1.0})


def test_two_rewards_with_one_label_are_refused(reward_module, tmp_path) -> None:
    (tmp_path / "other_rewards_mod.py").write_text("def brevity(completions, **kw):\n    return []\n")
    with pytest.raises(ValueError, match="both be called 'brevity'"):
        build_rewards({f"{reward_module}:brevity": 1.0, "other_rewards_mod:brevity": 1.0})
    sys.modules.pop("other_rewards_mod", None)


def test_score_completion_keys_import_path_rewards_by_label(reward_module) -> None:
    scored = score_completion("<SOLUTION>7</SOLUTION>", {"answer": "7"},
                              {"format_reward": 1.0, f"{reward_module}:brevity": 2.0})
    assert scored["rewards"] == {"format_reward": 1.0, "brevity": 1.0}
    assert scored["total"] == 3.0


def test_rouge_reward_scores_the_solution_block_against_the_gold() -> None:
    completions = ["<REASONING>r</REASONING><SOLUTION>the cat sat on the mat</SOLUTION>",
                   "<SOLUTION>a dog ran</SOLUTION>", "the cat sat on the mat", "<SOLUTION>x</SOLUTION>"]
    gold = ["the cat sat on the mat", "the cat sat on the mat", "the cat sat on the mat", None]
    values = rouge_reward(completions, answer=gold)
    assert values[0] == pytest.approx(1.0) and 0.0 <= values[1] < 0.5
    assert values[2] == 0.0  # no SOLUTION block: the format is part of the task
    assert values[3] is None  # no gold text: no signal
    partial = rouge_reward(["<SOLUTION>the cat sat</SOLUTION>"], answer=["the cat sat on the mat"],
                           rouge_type="rougeL")[0]
    assert partial == pytest.approx(2 * 1.0 * 0.5 / 1.5)  # precision 1, recall 1/2
    with pytest.raises(ValueError, match="rouge_type"):
        rouge_reward(["<SOLUTION>x</SOLUTION>"], answer=["x"], rouge_type="rouge9")


def test_bertscore_reward_on_a_local_model(tmp_path) -> None:
    """Hub ids in practice; here a tiny random Qwen3 text model on disk, so it runs offline."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    from vlmrl.models.embedded import tokenizer_files_dir

    model_dir = tmp_path / "encoder"
    Qwen3Model(Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16)).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tokenizer_files_dir()).save_pretrained(model_dir)
    funcs, _ = build_rewards({"bertscore_reward": 1.0}, {"bertscore_reward": {"model": str(model_dir)}})
    values = funcs[0](["<SOLUTION>the cat sat on the mat</SOLUTION>",
                       "<SOLUTION>seventeen purple engines</SOLUTION>", "no block", "<SOLUTION>a</SOLUTION>"],
                      answer=["the cat sat on the mat", "the cat sat on the mat", "a", None])
    assert funcs[0].__name__ == "bertscore_reward"
    assert values[0] == pytest.approx(1.0, abs=1e-5) and values[1] < values[0]
    assert values[2:] == [0.0, None]


def test_import_path_reward_is_used_by_training_and_evaluation(fresh_repo: Path) -> None:
    """A custom reward given by import path reaches TRL's log and the eval records and
    metrics."""
    from conftest import run, stage_command
    from project_repo import update_params

    (fresh_repo / "my_rewards.py").write_text(textwrap.dedent(BREVITY))
    update_params(fresh_repo, {"rewards.weights": {"format_reward": 1.0,
                                                   "my_rewards:brevity": 1.0}})
    for stage in ("prepare_data", "sft_cold_start", "baseline_eval", "train_gspo"):
        run(stage_command(stage, fresh_repo), fresh_repo)
    log = json.loads((fresh_repo / "data/metrics/train_log.json").read_text())
    assert any("rewards_brevity_mean" in row for row in log)
    records = [json.loads(line) for line in
               (fresh_repo / "data/eval/baseline/records.jsonl").read_text().splitlines()]
    assert all(record["reward_brevity"] in (0.0, 1.0) for record in records)
    metrics = json.loads((fresh_repo / "data/metrics/baseline_eval.json").read_text())
    assert set(metrics["rewards"]) == {"format_reward", "brevity"}
