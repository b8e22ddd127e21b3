"""Old log-probabilities only where a micro-batch is trained off-policy
(vlmrl.trainers.OldLogProbsWhereNeeded): a generation of 16 rows serving two optimizer steps of
two micro-batches each. The micro-batches of the first step are trained before any update and
carry none (TRL's loss then takes the current ones, detached); those of the second carry exactly
the values TRL's own generation-time pass gives them."""

from __future__ import annotations

from pathlib import Path

import torch

from vlmrl.models.loading import load_policy
from vlmrl.params import Params
from vlmrl.trainers import OldLogProbsWhereNeeded
from vlmrl.training import build_grpo_config, make_trainer

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
PARAMS = Params({"model": {"name": "embedded:tiny-qwen3-vl"},
                 "train": {"save_steps": 100, "lora": LORA}})
GRPO = {"max_steps": 1, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "steps_per_generation": 4, "num_generations": 4, "max_completion_length": 6,
        "logging_steps": 1, "seed": 5, "report_to": "none", "beta": 0.0,
        "importance_sampling_level": "sequence"}


def answer_length(completions, **_) -> list[float]:
    return [float(len(str(c))) for c in completions]


def buffered_generation(train_set, tmp_path: Path, **grpo) -> tuple[object, list[dict]]:
    """A trainer after its first optimizer step, and the micro-batches of its one generation."""
    torch.manual_seed(0)
    model, processor, _ = load_policy(PARAMS.model, PARAMS.train.lora, 5)
    config = build_grpo_config({**GRPO, **grpo}, output_dir=tmp_path, save_steps=100,
                               reward_weights=[1.0], model_settings=PARAMS.model)
    trainer = make_trainer(model.train(), processor, config, train_set, [answer_length],
                           generation_rows=None, callbacks=[])
    trainer.train()
    return trainer, trainer._buffered_inputs


def test_only_off_policy_micro_batches_are_scored_and_as_trl_scores_them(
        train_set, tmp_path: Path, monkeypatch) -> None:
    ours, batches = buffered_generation(train_set, tmp_path / "ours")
    assert len(batches) == 4
    assert ["old_per_token_logps" in batch for batch in batches] == [False, False, True, True]
    assert ours.old_logps_rows == 8  # TRL's own pass scores all 16

    monkeypatch.setattr(OldLogProbsWhereNeeded, "old_logps_where_needed", lambda self: False)
    trl_trainer, trl_batches = buffered_generation(train_set, tmp_path / "trl")
    assert trl_trainer.old_logps_rows == 0
    assert all("old_per_token_logps" in batch for batch in trl_batches)
    for index in (2, 3):  # the same rows, generated and shuffled alike
        assert torch.equal(batches[index]["completion_ids"], trl_batches[index]["completion_ids"])
        mask = batches[index]["completion_mask"].bool()
        torch.testing.assert_close(batches[index]["old_per_token_logps"][mask],
                                   trl_batches[index]["old_per_token_logps"][mask],
                                   rtol=1e-5, atol=1e-5)


def test_several_iterations_score_every_micro_batch(train_set, tmp_path: Path) -> None:
    """With num_iterations 2 every micro-batch is trained again after an update."""
    trainer, batches = buffered_generation(train_set, tmp_path, num_iterations=2)
    assert all("old_per_token_logps" in batch for batch in batches)
    assert trainer.old_logps_rows == 16


def test_aligned_steps_score_nothing(train_set, tmp_path: Path) -> None:
    """One generation per optimizer step: on-policy throughout, no old log-probs (TRL's own
    aligned path, untouched)."""
    trainer, batches = buffered_generation(train_set, tmp_path, steps_per_generation=2)
    assert not any("old_per_token_logps" in batch for batch in batches)
    assert trainer.old_logps_rows == 0
