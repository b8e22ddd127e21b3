"""verify_lora on the embedded model, through the real stage script: an untrained adapter (every
lora_B zero) and a mis-configured one must fail it, a trained one must pass."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run, stage_command, update_params

from vlmrl.params import LoraParams, ModelParams, ParamsError
from vlmrl.verification.lora import (
    check_language_model_only,
    check_target_modules,
    delta_w_squared_norm,
    lora_modules,
)

LANGUAGE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_base_model():
    from vlmrl.models.embedded import resolve_model_path
    from vlmrl.models.loading import load_transformers_model

    settings = ModelParams(name="embedded:tiny-qwen3-vl")
    return load_transformers_model(resolve_model_path(settings), settings)


def peft_model(*, r: int = 8, alpha: int = 16, targets=LANGUAGE_TARGETS, b_scale: float = 0.0,
               seed: int = 0):
    """A LoRA model on the tiny base; b_scale > 0 stands in for training: lora_B gets random
    values of that scale (PEFT initialises it to zero)."""
    import peft
    import torch

    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets,
                             bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny_base_model(), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name and b_scale:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * b_scale)
    return model


def make_adapter(out: Path, **kwargs) -> Path:
    peft_model(**kwargs).save_pretrained(out)
    return out


def prepare_workdir(root: Path) -> Path:
    """params.yaml and the prepared eval set, as the stages find them in a repository."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / "params.yaml", root / "params.yaml")
    _python, script, *args = stage_command("prepare_data")
    run([sys.executable, str(ROOT / script), *args], root)
    return root


def run_verify(workdir: Path, adapter: Path, params: Path | None = None):
    command = [sys.executable, str(ROOT / "stages/verify_lora.py"), "--adapter", str(adapter),
               "--eval-set", "data/prepared/eval", "--metrics", "data/metrics/verify_lora.json",
               "--details", "data/reports/details/verify_lora.json"]
    if params is not None:
        command += ["--params", str(params)]
    return run(command, workdir, check=False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return prepare_workdir(tmp_path_factory.mktemp("verify") / "repo")


@pytest.fixture(scope="module")
def trained_adapter(workdir: Path) -> Path:
    return make_adapter(workdir / "adapters/trained", b_scale=0.02)


def test_untrained_adapter_fails_and_lists_the_zero_tensors(workdir: Path) -> None:
    adapter = make_adapter(workdir / "adapters/untrained")
    metrics = workdir / "data/metrics/verify_lora.json"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text("{}")  # the last good run's result, which a failed run must keep

    result = run_verify(workdir, adapter)

    assert result.returncode == 1, result.stdout + result.stderr
    assert metrics.read_text() == "{}"
    assert "failed 2 of 7 checks" in result.stderr
    assert "lora_b_nonzero: 14 of 14 lora_B matrices are all zero" in result.stderr
    assert "model.language_model.layers.1.mlp.down_proj.lora_B" in result.stderr
    assert "logit_delta:" in result.stderr and "it does nothing" in result.stderr
    assert "FAIL lora_b_nonzero" in result.stdout  # the findings are printed


def test_trained_adapter_passes_and_writes_metrics(workdir: Path, trained_adapter: Path) -> None:
    result = run_verify(workdir, trained_adapter)

    assert result.returncode == 0, result.stdout + result.stderr
    metrics = json.loads((workdir / "data/reports/details/verify_lora.json").read_text())
    assert metrics["passed"] is True and metrics["checks_failed"] == 0
    assert all(check["passed"] for check in metrics["checks"].values())
    assert set(metrics["checks"]) == {"lora_b_nonzero", "rank", "alpha", "dropout",
                                      "target_modules", "language_model_only", "logit_delta"}
    assert metrics["tensors"] == {"adapted_modules": 14, "lora_A": 14, "lora_B": 14,
                                  "zero_lora_B": 0, "parameters": 65536}
    assert list(metrics["groups"]) == ["q", "k", "v", "o", "gate", "up", "down"]
    assert all(group["modules"] == 2 and group["lora_B"] > 0 and group["delta_w"] > 0
               for group in metrics["groups"].values())
    assert metrics["logit_delta"]["max_abs"] > 1e-3 > metrics["logit_delta"]["tolerance"]
    headline = json.loads((workdir / "data/metrics/verify_lora.json").read_text())
    assert headline == {"checks_failed": 0, "tensors": {"adapted_modules": 14, "zero_lora_B": 0,
                                                        "parameters": 65536},
                        "logit_delta": {key: metrics["logit_delta"][key]
                                        for key in ("max_abs", "mean_abs")}}


def test_wrong_rank_in_params_fails(workdir: Path, trained_adapter: Path, tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    shutil.copy2(workdir / "params.yaml", params)
    update_params(tmp_path, {"train.lora.r": 4, "train.lora.alpha": 8})

    result = run_verify(workdir, trained_adapter, params=params)

    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank: adapter_config r=8, params train.lora.r=4" in result.stderr
    assert "lora_A matrices of rank [8] where params say 4" in result.stderr
    assert "alpha: adapter_config lora_alpha=16, params train.lora.alpha=8.0" in result.stderr
    assert "lora_b_nonzero" not in result.stderr


def test_missing_adapter_is_a_clear_error(workdir: Path) -> None:
    result = run_verify(workdir, workdir / "no-such-adapter")
    assert result.returncode == 1
    assert "no LoRA adapter (adapter_config.json)" in result.stderr


def test_vision_tower_adapter_is_caught() -> None:
    model = peft_model(targets=LANGUAGE_TARGETS + ["qkv"], b_scale=0.01)
    modules = lora_modules(model)
    spec = LoraParams(r=8, alpha=16, dropout=0.0, target_modules=tuple(LANGUAGE_TARGETS))

    check = check_language_model_only(modules)
    assert not check.passed
    assert "model.visual.blocks.0.attn.qkv" in check.detail
    targets = check_target_modules({"target_modules": LANGUAGE_TARGETS + ["qkv"]}, modules, spec)
    assert not targets.passed and "extra ['qkv']" in targets.detail


def test_delta_w_norm_matches_the_explicit_product() -> None:
    import torch

    module = lora_modules(peft_model(b_scale=0.05, seed=3))[0]
    # the reference in float64 too: a float32 product's rounding depends on the BLAS kernel and
    # thread count, and missed rel=1e-9 in one run of a loaded machine
    explicit = float(torch.linalg.matrix_norm(module.lora_b.double() @ module.lora_a.double()) ** 2)
    assert delta_w_squared_norm(module) == pytest.approx(explicit, rel=1e-9)


def test_lora_spec_rejects_incomplete_params() -> None:
    with pytest.raises(ParamsError, match="train.lora.alpha"):
        LoraParams.from_params({"r": 8, "dropout": 0.0, "target_modules": ["q_proj"]})
    with pytest.raises(ParamsError, match="non-empty list"):
        LoraParams.from_params({"r": 8, "alpha": 16, "dropout": 0.0,
                                "target_modules": "q_proj"})
