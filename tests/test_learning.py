"""The policy gradient must have the right sign: a short GSPO run on fixed seeds raises a reward
the primed tiny model varies on, and the same run with that reward negated lowers it. Both are
measured the same way, after training, without sampling, so the test fails when learning breaks
(a zero learning rate, a flipped advantage, a detached loss leave the two runs equal or
reversed), not only when the log looks odd.

The reward is dense on purpose: the share of high digits (5-9) among the digits a completion
writes. The policy is first primed by a short cold-start SFT (`vlmrl.training.sft`), after which it
writes `The answer is N.` with varied digits, so the reward varies within every group from the
first step. A random model cannot serve: its 151,936 random embeddings carry no structure a few
updates could exploit, so any reward it is trained on stays flat on fresh samples (measured).

Measured (on a loaded machine): p(high digit) 0.536 -> 0.9999 with the reward, 0.536 ->
0.111 with it negated; with `learning_rate: 0.0` both stay at 0.5359 and the test fails."""

from __future__ import annotations

from pathlib import Path

import pytest
from datasets import load_from_disk

from vlmrl.data.prepare import load_raw_records, prepare, to_dataset
from vlmrl.models.loading import load_policy, starting_adapter
from vlmrl.params import DataParams, Params
from vlmrl.training.gspo import build_grpo_config, make_trainer
from vlmrl.training.rollout.generation import rollout_class
from vlmrl.training.sft import run_sft

MODEL = {"name": "embedded:tiny-qwen3-vl"}
LORA = {"r": 8, "alpha": 16, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"]}
SFT = {"enabled": True, "reasoning": "The answer is {answer}.",
       "args": {"max_steps": 20, "learning_rate": 3.0e-3, "lr_scheduler_type": "constant",
                "per_device_train_batch_size": 8, "seed": 3}}
GRPO = {"learning_rate": 1.0e-3, "lr_scheduler_type": "constant", "max_steps": 6,
        "per_device_train_batch_size": 8, "steps_per_generation": 2, "num_generations": 8,
        "max_completion_length": 12, "temperature": 1.0, "importance_sampling_level": "sequence",
        "epsilon": 3.0e-3, "epsilon_high": 4.0e-3, "beta": 0.0, "loss_type": "grpo",
        "logging_steps": 1, "seed": 7, "report_to": "none"}
PARAMS = Params({"model": MODEL, "sft": SFT, "train": {"save_steps": 100, "lora": LORA}})


def completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(part.get("text") or "" for message in completion
                   for part in (message["content"] if isinstance(message["content"], list)
                                else [{"text": message["content"]}]))


def high_digit_share(completions, **columns) -> list[float]:
    shares = []
    for text in map(completion_text, completions):
        digits = [ch for ch in text if ch.isdigit()]
        shares.append(sum(ch >= "5" for ch in digits) / len(digits) if digits else 0.0)
    return shares


def low_digit_preference(completions, **columns) -> list[float]:
    return [-value for value in high_digit_share(completions, **columns)]


@pytest.fixture(scope="module")
def primed(tmp_path_factory):
    """(train set, SFT adapter) on a small synthetic set."""
    root = tmp_path_factory.mktemp("learning")
    settings = DataParams(synthetic_size=24, synthetic_read_size=16, eval_size=4, image_size=64,
                          seed=5)
    to_dataset(prepare(load_raw_records(settings), settings).train).save_to_disk(
        str(root / "train"))
    run_sft(train_set=root / "train", params=PARAMS, out=root / "sft")
    return load_from_disk(str(root / "train")), starting_adapter(root / "sft")


def measured_high_digit_share(model, processor, rows) -> float:
    """The policy's preference for a high digit where the primed format writes its answer
    (`<REASONING>The answer is `): p(5-9) / p(0-9) of the next token, averaged over rows. Exact,
    so no sampling noise can fake or hide a change."""
    import torch

    from vlmrl.evaluation.evaluate import render_prompt
    from vlmrl.rewards.scoring import OPEN_REASONING

    texts = [render_prompt(processor, row) + OPEN_REASONING + "The answer is " for row in rows]
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=texts, images=[[row["image"]] for row in rows], return_tensors="pt",
                       padding=True)
    digits = processor.tokenizer.convert_tokens_to_ids(list("0123456789"))
    with torch.inference_mode():
        probs = model(**inputs).logits[:, -1].float().softmax(-1)[:, digits]
    return (probs[:, 5:].sum(-1) / probs.sum(-1)).mean().item()


def trained_share(primed, reward, tmp_path: Path) -> tuple[float, float]:
    """(high-digit share before, after) a short GSPO run optimising `reward`."""
    train_set, adapter = primed
    model, processor, _ = load_policy(PARAMS.model, PARAMS.train.lora, GRPO["seed"],
                                      init_adapter=adapter, model_class=rollout_class)
    rows = [train_set[i] for i in range(4)]
    before = measured_high_digit_share(model.eval(), processor, rows)
    config = build_grpo_config(GRPO, output_dir=tmp_path / "run", save_steps=100,
                               reward_weights=[1.0], model_settings=PARAMS.model)
    trainer = make_trainer(model.train(), processor, config, train_set, [reward],
                           generation_rows=None, callbacks=[])
    trainer.train()
    return before, measured_high_digit_share(trainer.model.eval(), processor, rows)


def test_gspo_raises_the_reward_and_lowers_its_negation(primed, tmp_path: Path) -> None:
    before, after = trained_share(primed, high_digit_share, tmp_path / "up")
    before_negated, after_negated = trained_share(primed, low_digit_preference, tmp_path / "down")
    assert before == pytest.approx(before_negated)  # same seeds, same starting policy
    assert after > before + 0.05, (before, after)
    assert after_negated < before - 0.05, (before, after_negated)
