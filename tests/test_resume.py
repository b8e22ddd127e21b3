"""Resuming keeps the user's training unless a setting that changes the result changed,
and even then the old checkpoints are moved aside with the changed keys printed."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from conftest import dvc_repro, update_params

from vlmrl.params import TrainParams
from vlmrl.training.checkpoints import (
    IO_ONLY,
    MEMORY_ONLY,
    changed_settings,
    finished_run,
    last_complete_checkpoint,
    mark_checkpoints,
    run_fingerprint,
    run_settings,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.fixture
def train_set(tmp_path: Path) -> Path:
    path = tmp_path / "train"
    path.mkdir()
    (path / "data-00000-of-00001.arrow").write_bytes(b"rows")
    return path


def settings_with(params: dict, train_set: Path, dotted: str, value) -> dict:
    changed = copy.deepcopy(params)
    node = changed
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return run_settings(changed, "adapter-sha", train_set)


@pytest.mark.parametrize(("key", "value"), [
    ("train.max_generation_rows", 8),
    ("train.grpo.gradient_checkpointing", True),
    ("train.grpo.logging_steps", 5),
    ("train.grpo.generation_kwargs", {"max_cache_len": 512, "disable_compile": False}),
    ("train.save_steps", 10),
    ("train.grpo.gradient_checkpointing_kwargs", {"use_reentrant": False}),  # a sub-key
    ("train.grpo.per_device_eval_batch_size", 64),
    ("train.grpo.report_to", ["tensorboard"]),
    ("train.resume", False),
])
def test_memory_only_settings_keep_the_fingerprint(params, train_set, key, value) -> None:
    before = run_settings(params, "adapter-sha", train_set)
    assert run_fingerprint(settings_with(params, train_set, key, value)) == run_fingerprint(before)


def test_every_unfingerprinted_key_is_a_real_setting() -> None:
    """A typo in the lists would fingerprint the real key: each names a GRPOConfig field (or a
    key under one) or a train param."""
    import dataclasses

    import trl

    grpo_fields = {field.name for field in dataclasses.fields(trl.GRPOConfig)}
    for key in [*MEMORY_ONLY, *IO_ONLY]:
        section, name, *_ = key.removeprefix("train.").split(".") + [""]
        if section == "grpo":
            assert name in grpo_fields, key
        else:
            assert section in TrainParams.model_fields, key


@pytest.mark.parametrize(("key", "value"), [
    ("train.grpo.learning_rate", 1.0e-5),
    ("train.grpo.generation_kwargs", {"max_cache_len": 512, "top_p": 0.9}),  # a sampling key
    ("train.lora.r", 16),
    ("rewards.weights.format_reward", 0.5),
    ("model.seed", 3),
])
def test_result_changing_settings_change_the_fingerprint(params, train_set, key, value) -> None:
    before = run_settings(params, "adapter-sha", train_set)
    assert run_fingerprint(settings_with(params, train_set, key, value)) != run_fingerprint(before)


def test_other_data_or_start_adapter_change_the_fingerprint(params, train_set) -> None:
    before = run_settings(params, "adapter-sha", train_set)
    assert run_settings(params, "other-adapter", train_set) != before
    (train_set / "data-00000-of-00001.arrow").write_bytes(b"more rows")
    assert run_settings(params, "adapter-sha", train_set) != before


def test_changed_settings_name_each_key() -> None:
    old = {"train.grpo.learning_rate": 3e-4, "train.lora.r": 8, "gone": 1}
    new = {"train.grpo.learning_rate": 1e-4, "train.lora.r": 8, "new": 2}
    assert changed_settings(old, new) == [
        "gone: removed (was 1)", "new: added (2)", "train.grpo.learning_rate: 0.0003 -> 0.0001"]
    assert "no settings" in changed_settings(None, new)[0]


def make_checkpoint(checkpoints: Path, step: int) -> Path:
    path = checkpoints / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return path


def test_same_settings_resume_from_the_newest_checkpoint(tmp_path) -> None:
    checkpoints = tmp_path / "train_gspo"
    settings = {"train.grpo.learning_rate": 3e-4}
    mark_checkpoints(checkpoints, settings)
    make_checkpoint(checkpoints, 2)
    newest = make_checkpoint(checkpoints, 4)
    assert last_complete_checkpoint(checkpoints, settings) == newest


def test_changed_settings_move_checkpoints_aside(tmp_path, capsys) -> None:
    checkpoints = tmp_path / "train_gspo"
    mark_checkpoints(checkpoints, {"train.grpo.learning_rate": 3e-4})
    make_checkpoint(checkpoints, 2)
    assert last_complete_checkpoint(checkpoints, {"train.grpo.learning_rate": 1e-4}) is None
    assert not checkpoints.exists()
    [moved] = tmp_path.glob("train_gspo.stale-*")
    assert (moved / "checkpoint-2/adapter_model.safetensors").read_bytes() == b"weights"
    assert json.loads((moved / "vlmrl_run.json").read_text())["settings"] == {
        "train.grpo.learning_rate": 3e-4}
    out = capsys.readouterr().out
    assert str(moved) in out
    assert "train.grpo.learning_rate: 0.0003 -> 0.0001" in out
    assert "nothing was deleted" in out


def test_resume_false_moves_checkpoints_aside_too(tmp_path, capsys) -> None:
    checkpoints = tmp_path / "train_gspo"
    settings = {"train.grpo.learning_rate": 3e-4}
    for _ in range(2):  # two moves in the same second get distinct names
        mark_checkpoints(checkpoints, settings)
        make_checkpoint(checkpoints, 2)
        assert last_complete_checkpoint(checkpoints, settings, resume=False) is None
    assert len(list(tmp_path.glob("train_gspo.stale-*"))) == 2
    assert "train.resume is false" in capsys.readouterr().out


def test_old_marker_without_settings_is_a_mismatch(tmp_path, capsys) -> None:
    checkpoints = tmp_path / "train_gspo"
    make_checkpoint(checkpoints, 2)
    (checkpoints / "vlmrl_run.json").write_text(json.dumps({"fingerprint": "abc"}))
    assert last_complete_checkpoint(checkpoints, {"a": 1}) is None
    assert "no settings" in capsys.readouterr().out
    assert len(list(tmp_path.glob("train_gspo.stale-*"))) == 1


def test_a_checkpoint_of_the_last_step_is_a_finished_run(tmp_path) -> None:
    """transformers 5.17 trains a step past max_steps when resumed from the last step's
    checkpoint, so such a checkpoint is taken as it is instead."""
    checkpoint = make_checkpoint(tmp_path, 4)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    assert finished_run(checkpoint, 4)
    assert not finished_run(checkpoint, 6)
    assert not finished_run(checkpoint, -1)  # no max_steps: the epochs bound the run
    assert not finished_run(None, 4)


def checkpoint_states(checkpoints: Path) -> dict[str, int]:
    """Each checkpoint's trainer state and when it was written: a step redone rewrites one."""
    return {path.parent.name: path.stat().st_mtime_ns
            for path in checkpoints.glob("checkpoint-*/trainer_state.json")}


def adapter_tensors(directory: Path) -> dict[str, list]:
    from safetensors.torch import load_file

    weights = load_file(str(directory / "adapter_model.safetensors"))
    return {name: tensor.tolist() for name, tensor in weights.items()}


@pytest.mark.slow
def test_dvc_repro_resumes_after_a_memory_only_change_and_moves_aside_after_another(
        fresh_repo: Path) -> None:
    """The user's path after an out-of-memory error: lower the rows per generate call, switch
    gradient checkpointing on, `dvc repro` again. DVC reruns train_gspo (its params changed) and
    the checkpoints survive (`persist: true`); the stage resumes from the last one and redoes no
    step. A learning-rate change then starts over, with the old checkpoints moved aside."""
    checkpoints = fresh_repo / "data/checkpoints/train_gspo"
    dvc_repro(fresh_repo, "train_gspo")
    first_log = json.loads((fresh_repo / "data/metrics/train_log.json").read_text())
    states = checkpoint_states(checkpoints)
    assert sorted(states) == ["checkpoint-2", "checkpoint-4"]

    update_params(fresh_repo, {"train.max_generation_rows": 4,
                               "train.grpo.gradient_checkpointing": True})
    result = dvc_repro(fresh_repo, "train_gspo")
    out = result.stdout + result.stderr
    assert "Running stage 'train_gspo'" in out
    assert "resuming from data/checkpoints/train_gspo/checkpoint-4" in out
    assert "not resuming" not in out
    assert checkpoint_states(checkpoints) == states  # no step redone, no checkpoint rewritten
    summary = json.loads((fresh_repo / "data/reports/details/train_gspo.json").read_text())
    assert summary["steps"] == 4
    assert summary["resumed_from"].endswith("checkpoint-4")
    assert json.loads((fresh_repo / "data/metrics/train_log.json").read_text()) == first_log
    assert "finished all 4 steps: nothing left to train" in out
    assert adapter_tensors(fresh_repo / "data/models/adapter") == adapter_tensors(
        checkpoints / "checkpoint-4")
    assert not list(checkpoints.parent.glob("train_gspo.stale-*"))

    update_params(fresh_repo, {"train.grpo.learning_rate": 1.0e-4})
    result = dvc_repro(fresh_repo, "train_gspo")
    out = result.stdout + result.stderr
    [moved] = checkpoints.parent.glob("train_gspo.stale-*")
    assert f"not resuming: old checkpoints moved to {moved.relative_to(fresh_repo)}" in out
    assert "train.grpo.learning_rate: 0.0003 -> 0.0001" in out
    assert "train.max_generation_rows" not in out  # a memory-only key is never a reason
    assert sorted(checkpoint_states(moved)) == ["checkpoint-2", "checkpoint-4"]
    summary = json.loads((fresh_repo / "data/reports/details/train_gspo.json").read_text())
    assert summary["steps"] == 4
    assert summary["resumed_from"] is None
    assert sorted(checkpoint_states(checkpoints)) == ["checkpoint-2", "checkpoint-4"]
