"""The `gpu` extra must install beside the torch a GPU machine already has (the device stack
tested here: torch 2.11.0+cu130, transformers 5.17.0), while the CPU set-up keeps torch 2.13.0;
and the bitsandbytes compile patch applies only to the versions it was written for."""

from __future__ import annotations

import re
import tomllib
import warnings

import pytest
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.version import Version

from vlmrl.training.trainer.chunked_generation import BNB_PATCH_VERSIONS, allow_compiling_bnb_4bit

DEVICE_TORCH = "2.11.0"  # /work/.library/device/KINDS.md: PyTorch 2.11.0+cu130 on the H100/H200
CPU_TORCH = "2.13.0"


def requirements(names: list[str]) -> dict[str, Requirement]:
    return {Requirement(line).name: Requirement(line) for line in names}


def test_torch_bounds_admit_the_device_stack_and_the_cpu_pin() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = requirements(project["dependencies"])
    assert Version(DEVICE_TORCH) in core["torch"].specifier
    assert Version(CPU_TORCH) in core["torch"].specifier
    assert Version("2.15.0") not in core["torch"].specifier  # Unsloth 2026.10.9's bound
    assert "torch" not in requirements(project["optional-dependencies"]["gpu"])
    assert Version("5.17.0") in core["transformers"].specifier  # the device's transformers
    setup = (ROOT / ".ci/setup").read_text()
    assert re.findall(r"torch==([\d.]+)", setup) and set(re.findall(r"torch==([\d.]+)", setup)) \
        == {CPU_TORCH}


@pytest.fixture
def quantizer():
    """transformers' class, which deciding must leave as it was (the trainer copies a policy's
    quantizer instead: vlmrl.training.trainer.chunked_generation.compileable_quantizer)."""
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    before = dict(Bnb4BitHfQuantizer.__dict__)
    yield Bnb4BitHfQuantizer
    assert dict(Bnb4BitHfQuantizer.__dict__) == before


def test_bnb_patch_applies_to_the_versions_it_was_written_for(quantizer) -> None:
    versions = {"transformers": "5.17.0", "bitsandbytes": "0.50.2"}
    assert BNB_PATCH_VERSIONS == {"transformers": "5.17", "bitsandbytes": "0.50"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert allow_compiling_bnb_4bit(versions) is True


@pytest.mark.parametrize("versions", [{"transformers": "5.17.0", "bitsandbytes": "0.51.0"},
                                      {"transformers": "5.18.1", "bitsandbytes": "0.50.0"}])
def test_bnb_patch_warns_and_stays_off_for_other_versions(quantizer, versions) -> None:
    before = quantizer.__dict__.get("is_compileable")
    with pytest.warns(UserWarning, match="patch was written for"):
        assert allow_compiling_bnb_4bit(versions) is False
    assert quantizer.__dict__.get("is_compileable") is before


def test_no_bitsandbytes_means_nothing_to_patch(quantizer) -> None:
    before = quantizer.__dict__.get("is_compileable")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert allow_compiling_bnb_4bit({"transformers": "5.17.0", "bitsandbytes": None}) is False
    assert quantizer.__dict__.get("is_compileable") is before


def test_auto_backend_is_transformers_even_with_unsloth_and_cuda(monkeypatch) -> None:
    """`model.backend: auto` never picks Unsloth: transformers was faster on every model measured
    (vlmrl.models.backend.pick_backend)."""
    import importlib.util

    from vlmrl.models import backend

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(backend, "cuda_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "unsloth" else real_find_spec(name, *a))
    assert backend.pick_backend("auto") == "transformers"
    assert backend.pick_backend("unsloth") == "unsloth"
