"""A release names its base model by a name that means the same on every machine, and carries
no value of the machine that made it: the adapter as PEFT saves it does both wrong,
and `make_adapter_portable`, called by train_gspo on the adapter it saves, puts it right."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from test_verify import make_adapter

from vlmrl.cache import cache_root
from vlmrl.models.portable import (
    machine_values,
    machine_values_in,
    make_adapter_portable,
    release_base_name,
    strip_machine_settings,
)
from vlmrl.models.unsloth import adapter_with_base


def test_release_base_name(tmp_path: Path) -> None:
    assert release_base_name("embedded:tiny-qwen3-vl") == "embedded:tiny-qwen3-vl"
    assert release_base_name("Qwen/Qwen3-VL-8B-Instruct") == "Qwen/Qwen3-VL-8B-Instruct"
    local = tmp_path / "my-model"
    local.mkdir()
    assert release_base_name(str(local)) == "local:my-model"
    assert release_base_name("./checkpoints/run-3") == "local:run-3"


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("adapter") / "adapter", b_scale=0.02)


def test_peft_adapter_is_made_portable(peft_adapter: Path, tmp_path: Path) -> None:
    config_before = json.loads((peft_adapter / "adapter_config.json").read_text())
    assert config_before["base_model_name_or_path"].startswith(str(cache_root()))
    assert "[More Information Needed]" in (peft_adapter / "README.md").read_text()
    files = lambda: [p for p in peft_adapter.iterdir() if p.is_file()]
    assert machine_values_in(files()) != []

    make_adapter_portable(peft_adapter, "embedded:tiny-qwen3-vl")

    config = json.loads((peft_adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "embedded:tiny-qwen3-vl"
    assert config["target_modules"] == sorted(config_before["target_modules"])
    unchanged = lambda c: {k: v for k, v in c.items()
                           if k not in ("base_model_name_or_path", "target_modules")}
    assert unchanged(config) == unchanged(config_before)
    assert not (peft_adapter / "README.md").exists()
    assert machine_values_in(files()) == []

    local = adapter_with_base(peft_adapter, "/models/base", tmp_path / "copy")
    assert json.loads((local / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "/models/base"
    assert (local / "adapter_model.safetensors").read_bytes() == (
        peft_adapter / "adapter_model.safetensors").read_bytes()


def test_machine_settings_are_stripped(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "local_files_only": False, "is_local": True,
         "nested": {"local_files_only": True, "keep": 1}}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    assert strip_machine_settings(tmp_path) == ["tokenizer_config.json"]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {
        "eos_token": "<|im_end|>", "nested": {"keep": 1}}
    assert machine_values_in([tmp_path / "tokenizer_config.json"]) == []


def test_machine_values_skip_names_that_are_words() -> None:
    values = machine_values()
    assert f"{Path.home()}/" in values and f"{cache_root()}/" in values
    host = socket.gethostname()
    assert (host in values) == (len(host) >= 5)


def test_text_only_scan_reads_text_files(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text(f"built in {Path.home()}/work")
    (tmp_path / "blob.bin").write_bytes(f"{Path.home()}/x".encode())
    paths = sorted(tmp_path.iterdir())
    assert machine_values_in(paths, text_only=True) == [f"{tmp_path / 'notes.md'}: {Path.home()}/"]
    assert len(machine_values_in(paths)) == 2
