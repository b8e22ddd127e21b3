"""dvc.yaml's training stages with the default `train.distributed` and `eval.num_processes`
(`auto`) on a host with two GPUs: sft_cold_start, train_gspo and baseline_eval each relaunch
themselves with one process per GPU, rank 0 alone writes under data/, GSPO acts on every step, and
the adapter passes verify_lora. The 2B-shaped model and the stage tests' small settings
(test_stages_gpu.SMALL) with transformers in bf16; skipped with fewer than two GPUs.

Writes are seen by tests/write_audit's sitecustomize (Python-level opens, renames, removals under
./data of every launched rank). Run on the device with `tests/gpu/run_on_device.sh tests
tests/gpu/test_two_gpus_gpu.py` (tests/gpu/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_stages_gpu import (
    GSPO,
    ROOT,
    SMALL,
    gpu_cache,  # noqa: F401  (the session fixture: the 2B-shaped model built on the GPU)
    make_copy,
    optimizer_steps,
    read_json,
    run_stage,
)

from vlmrl.distributed.launch import visible_gpus

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(visible_gpus() < 2, reason="needs two GPUs (nvidia-smi -L)")]

AUDIT_SITE = ROOT / "tests" / "write_audit"
TWO_GPUS = {**SMALL, "model.backend": "transformers", "model.load_in_4bit": False}


def audit_lines(audit: Path, rank: int) -> list[str]:
    return [line for path in sorted(audit.glob(f"rank{rank}-*.txt"))
            for line in path.read_text().splitlines()]


def test_defaults_train_and_evaluate_on_both_gpus(gpu_cache, tmp_path,  # noqa: F811
                                                  monkeypatch) -> None:
    repo = make_copy(tmp_path / "repo", TWO_GPUS)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["train"]["distributed"] == yaml.safe_load(
        (ROOT / "params.yaml").read_text())["train"]["distributed"]  # the shipped defaults
    assert params["train"]["distributed"]["strategy"] == "auto"
    assert params["eval"]["num_processes"] == "auto"
    audit = tmp_path / "audit"
    audit.mkdir()
    monkeypatch.setenv("VLMRL_WRITE_AUDIT", str(audit))
    audited = (str(AUDIT_SITE),)
    run_stage(repo, "prepare_data", "two-gpus")
    outputs = {name: run_stage(repo, name, "two-gpus", audited)
               for name in ("sft_cold_start", "train_gspo", "baseline_eval")}
    for name, result in outputs.items():
        assert "launching 2 process(es) with ddp.yaml" in result.stdout, f"{name}: {result.stdout}"
    run_stage(repo, "verify_lora", "two-gpus")

    sft = read_json(repo / "data/reports/details/sft_cold_start.json")["batch"]
    assert (sft["num_processes"], sft["strategy"]) == (2, "ddp")
    batch = read_json(repo / "data/reports/details/train_gspo.json")["batch"]
    assert (batch["num_processes"], batch["strategy"]) == (2, "ddp")
    assert batch["global_batch_size"] == GSPO["train.grpo.per_device_train_batch_size"]
    assert batch["rows_per_process"] == [16, 16] and batch["prompts_in_several_processes"] == 0
    rows = optimizer_steps(repo)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(isinstance(row.get("grad_norm"), float) and row["grad_norm"] > 0 for row in rows)
    assert read_json(repo / "data/metrics/verify_lora.json")["checks_failed"] == 0
    assert read_json(repo / "data/metrics/baseline_eval.json")["n"] == SMALL["data.eval_size"]

    rank0, rank1 = audit_lines(audit, 0), audit_lines(audit, 1)
    assert any(line.endswith("data/metrics/train.json") for line in rank0), rank0[:20]
    assert rank1 == [], rank1[:20]
    assert len(list(audit.glob("rank1-*.txt"))) >= 3, "rank 1 of each launched stage"


def test_strategy_none_trains_on_one_gpu_and_says_so(gpu_cache, tmp_path) -> None:  # noqa: F811
    """What crashed before `auto` (TRL refuses the nn.DataParallel that transformers' Trainer
    wraps a model in when one process sees several GPUs): `strategy: none` keeps the first GPU."""
    repo = make_copy(tmp_path / "repo", {**TWO_GPUS, "sft.enabled": False,
                                         "train.distributed.strategy": "none"})
    run_stage(repo, "prepare_data", "two-gpus-none")
    run_stage(repo, "sft_cold_start", "two-gpus-none")  # a pass-through: nothing to train
    result = run_stage(repo, "train_gspo", "two-gpus-none")
    assert ("train_gspo: train.distributed.strategy none, num_processes auto: one process on "
            "GPU 0 of the 2 visible (CUDA_VISIBLE_DEVICES=0)") in result.stdout, result.stdout
    assert "launching" not in result.stdout
    batch = read_json(repo / "data/reports/details/train_gspo.json")["batch"]
    assert (batch["num_processes"], batch["strategy"]) == (1, "none")
