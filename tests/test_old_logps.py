"""Old log-probabilities only where a micro-batch is trained off-policy
(vlmrl.training.trainer.mixins.OldLogProbsWhereNeeded): a generation of 16 rows serving two optimizer steps of
two micro-batches each. The micro-batches of the first step are trained before any update and
carry none (TRL's loss then takes the current ones, detached); those of the second carry exactly
the values TRL's own generation-time pass gives them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlmrl.models.loading import load_policy
from vlmrl.params import Params
from vlmrl.training.gspo import build_grpo_config, make_trainer
from vlmrl.training.trainer.mixins import OldLogProbsWhereNeeded
from vlmrl.training.trainer.private_names import UpstreamChangedError

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


@pytest.mark.parametrize("grpo", [{"num_iterations": 2}, {"steps_per_generation": 3}],
                         ids=["two-iterations", "generation-inside-a-step"])
def test_other_shapes_are_scored_by_trl_itself(train_set, tmp_path: Path, grpo) -> None:
    """Every micro-batch trained again after an update (num_iterations 2), or generations that
    start inside an optimizer step (3 micro-batches a generation, 2 a step): TRL's own pass
    scores every row, none is left to the switch."""
    trainer, batches = buffered_generation(train_set, tmp_path, **grpo)
    assert all("old_per_token_logps" in batch for batch in batches)
    assert trainer.old_logps_rows == 0


def test_a_trl_that_no_longer_scores_at_generation_fails_in_one_line(
        train_set, tmp_path: Path, monkeypatch) -> None:
    """Were TRL's generation to stop making the scoring pass the switch skips (here: the pass
    never reaches the switch), the off-policy rows would silently go unscored: the trainer says
    so instead."""
    monkeypatch.setattr(OldLogProbsWhereNeeded, "_get_per_token_logps_and_entropies",
                        lambda self, *args, **kwargs: super(OldLogProbsWhereNeeded, self)
                        ._get_per_token_logps_and_entropies(*args, **kwargs))
    with pytest.raises(UpstreamChangedError, match=r"no longer scores old log-probabilities"):
        buffered_generation(train_set, tmp_path)


def test_aligned_steps_score_nothing(train_set, tmp_path: Path) -> None:
    """One generation per optimizer step: on-policy throughout, no old log-probs (TRL's own
    aligned path, untouched)."""
    trainer, batches = buffered_generation(train_set, tmp_path, steps_per_generation=2)
    assert not any("old_per_token_logps" in batch for batch in batches)
    assert trainer.old_logps_rows == 0
