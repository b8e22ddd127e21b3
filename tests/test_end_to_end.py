"""The whole chain as a user runs it: `dvc repro` through all seven stages on the embedded
default, a second `dvc repro` that recomputes nothing, and a train param changed through a DVC
experiment that reruns exactly train_gspo and the stages after it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import dvc_repro, run

STAGES = ["prepare_data", "sft_cold_start", "baseline_eval", "train_gspo", "post_eval",
          "verify_lora", "export", "upload"]
AFTER_TRAIN = STAGES[3:]


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


@pytest.fixture(scope="module")
def reproduced(pipeline_repo: Path) -> Path:
    result = dvc_repro(pipeline_repo)
    output = result.stdout + result.stderr
    assert "nothing was uploaded" in output
    return pipeline_repo


@pytest.mark.slow
def test_every_stage_produced_its_outputs(reproduced: Path) -> None:
    data = reproduced / "data"
    for path in ("prepared/train", "prepared/eval", "eval/baseline/records.jsonl",
                 "eval/post/records.jsonl", "models/adapter/adapter_model.safetensors",
                 "models/merged/model.safetensors", "models/gguf/model-f16.gguf",
                 "models/gguf/mmproj-f16.gguf", "reports/eval/report.md",
                 "reports/upload_manifest.json", "reports/model_card.md"):
        assert (data / path).exists(), path
    upload = json.loads((data / "reports/details/upload.json").read_text())
    assert upload["uploaded"] is False


@pytest.mark.slow
def test_second_repro_recomputes_nothing(reproduced: Path) -> None:
    result = dvc_repro(reproduced)
    assert ran_stages(result.stdout) == []
    for stage in STAGES:
        assert f"Stage '{stage}' didn't change, skipping" in result.stdout
    status = run(["dvc", "status"], reproduced)
    assert "up to date" in status.stdout


@pytest.mark.slow
def test_train_param_experiment_reruns_train_and_after(reproduced: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "reproduced"], repo)

    # max_steps, not the learning rate: after the tests' 2-step SFT, a learning-rate experiment
    # left train.json unchanged (seeded training, no wall-clock figures); the step count shows.
    result = run(["dvc", "exp", "run", "-S", "train.grpo.max_steps=2"], repo)
    assert ran_stages(result.stdout) == AFTER_TRAIN
    assert "Stage 'prepare_data' didn't change" in result.stdout
    assert "Stage 'baseline_eval' didn't change" in result.stdout

    params_diff = run(["dvc", "params", "diff", "--json"], repo).stdout
    changed = json.loads(params_diff)["params.yaml"]
    assert (changed["train.grpo.max_steps"]["old"], changed["train.grpo.max_steps"]["new"]) == (4, 2)
    metrics_diff = json.loads(run(["dvc", "metrics", "diff", "--json"], repo).stdout)
    assert "data/metrics/train.json" in metrics_diff

    shown = json.loads(run(["dvc", "exp", "show", "--json"], repo).stdout)
    text = json.dumps(shown)
    assert "post_eval.json" in text and "baseline_eval.json" in text
    assert '"max_steps": 2' in text


@pytest.mark.slow
def test_eval_param_experiment_reruns_the_evals_and_not_export(reproduced: Path,
                                                               tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(reproduced, repo, symlinks=True)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "reproduced"], repo)

    result = run(["dvc", "exp", "run", "-S", "eval.max_new_tokens=40"], repo)
    assert ran_stages(result.stdout) == ["baseline_eval", "post_eval", "upload"]
    for stage in ("train_gspo", "verify_lora", "export"):
        assert f"Stage '{stage}' didn't change" in result.stdout
