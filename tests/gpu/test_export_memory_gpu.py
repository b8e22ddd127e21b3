"""Merging on a GPU never moves the model to float32 there (an 8B model would need
32 GB for its weights alone). The transformers merge of a 2B-shaped model with a known adapter
must peak below 1.5x its bf16 weights in device memory (float32 alone would be 2x), and still
write base + adapter exactly (weight-space check). Also: the device stack's torch is inside the
core bound, and the bitsandbytes compile patch applies to the device's versions."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from test_unsloth_merge_gpu import eval_row, known_adapter, model_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_transformers_merge_stays_16_bit_on_the_gpu(model_dir, known_adapter, eval_row,  # noqa: F811
                                                    tmp_path: Path) -> None:
    import torch

    from vlmrl.export.checks import checkpoint_parameters
    from vlmrl.models.loading import merge_adapter
    from vlmrl.models.merged_weights import compare_merged_weights
    from vlmrl.params import ModelParams

    settings = ModelParams(name=str(model_dir), backend="transformers", dtype="bfloat16")
    torch.cuda.reset_peak_memory_stats()
    merge_adapter(settings, "bfloat16", known_adapter, eval_row, tmp_path / "merged",
                  tmp_path / "base")
    peak = torch.cuda.max_memory_allocated()
    weights = 2 * checkpoint_parameters(model_dir)
    print(f"peak device memory {peak / 2**30:.2f} GiB for {weights / 2**30:.2f} GiB of bf16 "
          "weights")
    assert peak < 1.5 * weights
    report = compare_merged_weights(tmp_path / "base", tmp_path / "merged", known_adapter,
                                    dtype="bfloat16")
    assert report.passed, report.detail()


def test_device_stack_is_inside_the_bounds() -> None:
    from importlib.metadata import version

    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    from vlmrl.training.trainer.chunked_generation import allow_compiling_bnb_4bit

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_bound = next(Requirement(r) for r in project["dependencies"] if r.startswith("torch"))
    print(f"torch {torch.__version__}, transformers {version('transformers')}, bitsandbytes "
          f"{version('bitsandbytes')}")
    assert Version(torch.__version__.split("+")[0]) in torch_bound.specifier
    assert allow_compiling_bnb_4bit() is (version("bitsandbytes").startswith("0.50.")
                                          and version("transformers").startswith("5.17."))
