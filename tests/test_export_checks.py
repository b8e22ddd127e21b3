"""The export preflight sizes a checkpoint from its safetensors headers alone: the count must be
the model's own, whatever the dtype, and a damaged file an error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmrl.errors import UserError
from vlmrl.export.checks import checkpoint_parameters
from vlmrl.models.embedded import ensure_embedded_model


def test_checkpoint_parameters_match_the_model_in_any_dtype(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_embedded_model("embedded:tiny-qwen3"))
    expected = sum(parameter.numel() for parameter in model.parameters())
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20MB")
    assert len(list((tmp_path / "bf16").glob("*.safetensors"))) > 1  # shards summed
    assert checkpoint_parameters(tmp_path / "bf16") == expected


def test_a_damaged_checkpoint_is_named(tmp_path: Path) -> None:
    source = next(Path(ensure_embedded_model("embedded:tiny-qwen3")).glob("*.safetensors"))
    cut = tmp_path / source.name
    cut.write_bytes(source.read_bytes()[:1000])
    with pytest.raises(UserError, match=f"^{cut}: not a readable safetensors file"):
        checkpoint_parameters(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors checkpoint"):
        checkpoint_parameters(tmp_path / "empty")


def test_available_memory_is_what_the_kernel_reports() -> None:
    from vlmrl.export.checks import available_memory

    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        pytest.skip("no /proc/meminfo: not Linux")
    line = next(line for line in meminfo.read_text().splitlines()
                if line.startswith("MemAvailable:"))
    kernel = int(line.split()[1]) * 1024
    assert abs(available_memory() - kernel) < 0.1 * kernel  # other processes come and go
