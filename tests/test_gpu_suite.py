"""The GPU suite's parametrization, checked where CI runs: the GPU tests themselves only run on a
lent device, where a wrongly parametrized test costs device time before it shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_downstream_stage_tests_run_per_trained_configuration():
    """`test_downstream` takes each configuration that test_train_gspo trains and downstream
    stages use, not the stage names (a second `DOWNSTREAM` once shadowed the first)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
         "no:cacheprovider", "tests/gpu/test_stages_gpu.py"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    downstream = sorted(line.split("[", 1)[1].rstrip("]") for line in listed.splitlines()
                        if "::test_downstream[" in line)
    trained = {line.split("[", 1)[1].rstrip("]") for line in listed.splitlines()
               if "::test_train_gspo[" in line}
    assert downstream == ["transformers-4bit", "transformers-bf16", "unsloth-4bit"]
    assert set(downstream) < trained
