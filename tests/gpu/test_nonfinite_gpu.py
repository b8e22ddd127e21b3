"""Regression: transformers bf16 on data seed 7 with the default params
(the tiny embedded model) logged `grad_norm: nan` at GSPO step 3 and then failed in a CUDA
device-side assert during the next generation. It must train to the end, with finite weights.

Run on the device machine with `tests/gpu/run_on_device.sh tests tests/gpu/test_nonfinite_gpu.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from project_repo import copy_project, stage_command

SEED_KEYS = ("data.seed", "sft.args.seed", "train.grpo.seed")


def run_stage(name: str, repo: Path) -> None:
    argv = stage_command(name, repo)
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(repo / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    result = subprocess.run(argv, cwd=repo, env=env, text=True, capture_output=True, timeout=900,
                            check=False)
    print(result.stdout[-2000:])
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


@pytest.mark.parametrize("seed", [7])
def test_bf16_default_run_trains_to_the_end_with_finite_weights(tmp_path: Path, seed: int) -> None:
    repo = copy_project(tmp_path / "repo", {**dict.fromkeys(SEED_KEYS, seed),
                                            "model.backend": "transformers",
                                            "model.dtype": "bfloat16"})
    for stage in ("prepare_data", "sft_cold_start", "train_gspo"):
        run_stage(stage, repo)
    metrics = json.loads((repo / "data/metrics/train.json").read_text())
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert metrics["steps"] == params["train"]["grpo"]["max_steps"]
    print("train metrics:", json.dumps(metrics))
    for name, tensor in load_file(repo / "data/models/adapter/adapter_model.safetensors").items():
        assert torch.isfinite(tensor).all(), name
