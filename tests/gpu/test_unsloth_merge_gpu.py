"""The Unsloth export path in weight space: the 16-bit base Unsloth loads must be the checkpoint,
bit for bit, and Unsloth's `save_pretrained_merged` must write the checkpoint plus the adapter.
A known adapter (random lora_B) is made with PEFT on the same 2B-shaped model, so no training is
needed; the stage test in test_stages_gpu.py runs the same merge after real training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("VLMRL_GPU_TEST_MODEL", "embedded:qwen3-vl-2b-shape")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    import torch

    from vlmrl.models.embedded import ensure_embedded_model

    os.environ.setdefault("VLMRL_CACHE", str(tmp_path_factory.mktemp("vlmrl-cache")))
    return Path(ensure_embedded_model(MODEL, seed=0,
                                      device="cuda" if torch.cuda.is_available() else "cpu"))


@pytest.fixture(scope="module")
def known_adapter(model_dir: Path, tmp_path_factory) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                        exclude_modules=r".*\.visual\..*")
    peft = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    peft.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def eval_row():
    from vlmrl.data.prepare import load_raw_records, prepare
    from vlmrl.params import DataParams

    settings = DataParams(synthetic_size=8, eval_size=2, image_size=512)
    return prepare(load_raw_records(settings), settings).eval[0]


def differing_tensors(first: Path, second: Path) -> dict[str, str]:
    """name -> how it differs, for tensors of `first` that `second` lacks or holds otherwise
    (`first` is cast to `second`'s dtype first: the embedded checkpoint may be float32)."""
    import torch

    from vlmrl.models.merged_weights import open_checkpoint

    found: dict[str, str] = {}
    with open_checkpoint(first) as a, open_checkpoint(second) as b:
        for name, (handle, key) in a.items():
            if name not in b:
                found[name] = "missing"
                continue
            x, y = handle.get_tensor(key), b[name][0].get_tensor(b[name][1])
            if x.shape != y.shape or not torch.equal(x.to(y.dtype), y):
                x, y = x.float(), y.float()
                found[name] = (f"max|diff| {float((x - y).abs().max()):.3g}, std {float(x.std()):.3g}"
                               f" vs {float(y.std()):.3g}" if x.shape == y.shape else
                               f"shape {tuple(x.shape)} vs {tuple(y.shape)}")
    return found


def summarize(report) -> str:
    return json.dumps({"passed": report.passed, "adapted": report.adapted,
                       "unchanged_checked": report.unchanged_checked,
                       "wrong": report.wrong[:8], "missing": report.missing[:8],
                       "max_ulps": report.max_ulps,
                       "changed_fraction": report.changed_fraction})


def test_unsloth_base_is_the_checkpoint_and_merge_adds_the_adapter(model_dir, known_adapter,
                                                                     eval_row, tmp_path):
    import torch

    from vlmrl.models.forward import max_abs_diff
    from vlmrl.models.loading import merge_adapter
    from vlmrl.models.merged_weights import compare_merged_weights
    from vlmrl.params import ModelParams

    settings = ModelParams(name=str(model_dir), backend="unsloth", dtype="bfloat16")
    merged, base = tmp_path / "merged", tmp_path / "base"
    adapter_logits, base_logits = merge_adapter(settings, "bfloat16", known_adapter, eval_row,
                                                merged, base)
    effect = max_abs_diff(adapter_logits, base_logits)
    base_changes = differing_tensors(model_dir, base)
    merged_report = compare_merged_weights(base, merged, known_adapter)
    print(f"adapter effect on the logits {effect:.4g}")
    print(f"Unsloth-saved base vs checkpoint: {len(base_changes)} tensors differ: "
          f"{json.dumps(dict(list(base_changes.items())[:12]), indent=1)}")
    print(f"Unsloth merged vs saved base + adapter: {summarize(merged_report)}")
    torch.cuda.empty_cache()

    assert not base_changes
    assert merged_report.passed, merged_report.detail()


def test_export_stage_on_the_unsloth_path(model_dir, known_adapter, tmp_path):
    """The export stage script (merge, weight and logit checks, GGUF f16 + mmproj, base control)
    with Unsloth's merged save, on the known adapter. It runs in its own process, as DVC runs it:
    a pytest process that had run Unsloth's merge and llama.cpp in-process once died of a
    segmentation fault at interpreter exit, after its test had passed."""
    import yaml

    from vlmrl.data.prepare import load_raw_records, prepare, to_dataset
    from vlmrl.params import DataParams, read_params_file

    root = Path(__file__).resolve().parents[2]
    settings = DataParams(synthetic_size=8, eval_size=2, image_size=512)
    eval_set = tmp_path / "eval"
    to_dataset(prepare(load_raw_records(settings), settings).eval).save_to_disk(str(eval_set))
    params = read_params_file(root / "params.yaml")
    params["model"].update(name=MODEL, backend="unsloth", load_in_4bit=False, dtype="auto")
    params["export"].update(gguf_outtypes=["f16"], quantize=[])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    metrics_file = tmp_path / "details" / "export.json"  # the full result; metrics: headline

    result = subprocess.run(
        [sys.executable, "stages/export.py", "--adapter", str(known_adapter),
         "--eval-set", str(eval_set), "--merged", str(tmp_path / "merged"),
         "--gguf", str(tmp_path / "gguf"), "--metrics", str(tmp_path / "metrics.json"),
         "--details", str(metrics_file),
         "--timings", str(tmp_path / "timings.json"),
         "--params", str(tmp_path / "params.yaml")],
        cwd=root, text=True, capture_output=True, check=False,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(root / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])))
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-6000:]}"
    metrics = json.loads(metrics_file.read_text())
    print(json.dumps({"checks": metrics["checks"], "diffs": metrics["logit_max_abs_diff"],
                      "tolerances": metrics["tolerances"],
                      "timings": json.loads((tmp_path / "timings.json").read_text())},
                     indent=1))
    assert metrics["passed"]
    assert metrics["checks"]["merged_weights_match_adapter"]["passed"]
    assert {p.name for p in (tmp_path / "gguf").glob("*.gguf")} == {"model-f16.gguf",
                                                                      "mmproj-f16.gguf"}
