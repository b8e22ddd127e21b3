"""The weight-space merge check on small checkpoints written the way PEFT and transformers write
them: a real PEFT merge must pass, and every way a merge can go wrong must be named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlmrl.models.merged_weights import (
    MergeCheckError,
    canonical_name,
    compare_merged_weights,
    read_lora_deltas,
)

Q = "model.language_model.layers.0.self_attn.q_proj.weight"
UP = "model.language_model.layers.0.mlp.up_proj.weight"
NORM = "model.language_model.layers.0.input_layernorm.weight"
VISUAL = "model.visual.blocks.0.attn.qkv.weight"


class Tiny(torch.nn.Module):
    """Module names as in Qwen3-VL, so the adapter's keys look like a real one's."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.q_proj = torch.nn.Linear(32, 32, bias=False)
        layer.mlp = torch.nn.Module()
        layer.mlp.up_proj = torch.nn.Linear(32, 48, bias=False)
        layer.input_layernorm = torch.nn.LayerNorm(32, bias=False)
        language_model = torch.nn.Module()
        language_model.layers = torch.nn.ModuleList([layer])
        block = torch.nn.Module()
        block.attn = torch.nn.Module()
        block.attn.qkv = torch.nn.Linear(16, 48, bias=False)
        visual = torch.nn.Module()
        visual.blocks = torch.nn.ModuleList([block])
        self.model = torch.nn.Module()
        self.model.language_model = language_model
        self.model.visual = visual

    def forward(self, x):
        return self.model.language_model.layers[0].mlp.up_proj(x)


@pytest.fixture()
def merged_case(tmp_path: Path) -> dict[str, Path]:
    """base, adapter and PEFT's own merge of them, all saved in bfloat16 like the export."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = Tiny().to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in base.state_dict().items()},
              str(tmp_path / "base.safetensors"))
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    peft.save_pretrained(tmp_path / "adapter")
    merged = peft.float().merge_and_unload().to(torch.bfloat16)
    (tmp_path / "base").mkdir()
    (tmp_path / "base.safetensors").rename(tmp_path / "base/model.safetensors")
    (tmp_path / "merged").mkdir()
    save_file({k: v.contiguous() for k, v in merged.state_dict().items()},
              str(tmp_path / "merged/model.safetensors"))
    return {"base": tmp_path / "base", "merged": tmp_path / "merged",
            "adapter": tmp_path / "adapter"}


def rewrite(path: Path, change) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_canonical_names_line_up_peft_transformers_and_unsloth_keys() -> None:
    expected = "language_model.layers.0.self_attn.q_proj"
    assert canonical_name("base_model.model.model.language_model.layers.0.self_attn.q_proj") \
        == expected
    assert canonical_name("model.language_model.layers.0.self_attn.q_proj") == expected
    assert canonical_name("language_model.model.layers.0.self_attn.q_proj") == expected


def test_adapter_deltas_carry_peft_scale(merged_case) -> None:
    deltas = read_lora_deltas(merged_case["adapter"])
    assert set(deltas) == {canonical_name(Q), canonical_name(UP)}
    assert {d.scale for d in deltas.values()} == {2.0}  # lora_alpha 8 / r 4
    assert deltas[canonical_name(UP)].weight_delta().shape == (48, 32)


def test_a_real_peft_merge_passes(merged_case) -> None:
    report = compare_merged_weights(merged_case["base"], merged_case["merged"],
                                    merged_case["adapter"])
    assert report.passed, report.detail()
    assert report.adapted == 2 and report.unchanged_checked == 2
    assert 0 < report.max_ulps <= 0.5  # one round-to-nearest
    assert report.changed_fraction > 0.5


def test_unmerged_checkpoint_fails_on_every_adapted_weight(merged_case) -> None:
    report = compare_merged_weights(merged_case["base"], merged_case["base"],
                                    merged_case["adapter"])
    assert not report.passed
    assert len(report.wrong) == 2 and "ulp from W + scale*B@A" in report.detail()


def test_double_scaled_merge_fails(merged_case) -> None:
    base = load_file(str(merged_case["base"] / "model.safetensors"))
    deltas = read_lora_deltas(merged_case["adapter"])

    def double(tensors):
        delta = deltas[canonical_name(UP)].weight_delta()
        tensors[UP] = (base[UP].float() + 2 * delta).to(torch.bfloat16)

    rewrite(merged_case["merged"], double)
    report = compare_merged_weights(merged_case["base"], merged_case["merged"],
                                    merged_case["adapter"])
    assert [w.split(" ")[0] for w in report.wrong] == [canonical_name(UP)]


def test_touched_frozen_tensor_and_missing_tensor_are_named(merged_case) -> None:
    def damage(tensors):
        tensors[VISUAL] = tensors[VISUAL] + 1
        del tensors[NORM]

    rewrite(merged_case["merged"], damage)
    report = compare_merged_weights(merged_case["base"], merged_case["merged"],
                                    merged_case["adapter"])
    assert not report.passed
    assert report.missing == [canonical_name(NORM)]
    assert report.wrong == [f"{canonical_name(VISUAL)} (not adapted, differs from the base)"]


def test_unsloth_style_names_are_matched(merged_case) -> None:
    tensors = load_file(str(merged_case["merged"] / "model.safetensors"))
    renamed = {key.replace("model.language_model.", "language_model.model."): value
               for key, value in tensors.items()}
    (merged_case["merged"] / "model.safetensors").unlink()
    save_file(renamed, str(merged_case["merged"] / "model-00001-of-00001.safetensors"))
    report = compare_merged_weights(merged_case["base"], merged_case["merged"],
                                    merged_case["adapter"])
    assert report.passed, report.detail()


def test_rslora_and_rank_pattern_scales(merged_case) -> None:
    config_path = merged_case["adapter"] / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(use_rslora=True, alpha_pattern={"up_proj": 16})
    config_path.write_text(json.dumps(config))
    deltas = read_lora_deltas(merged_case["adapter"])
    assert deltas[canonical_name(Q)].scale == pytest.approx(8 / 2)   # 8 / sqrt(4)
    assert deltas[canonical_name(UP)].scale == pytest.approx(16 / 2)


def test_missing_adapter_or_checkpoint_is_a_clear_error(merged_case, tmp_path: Path) -> None:
    with pytest.raises(MergeCheckError, match="adapter_model.safetensors"):
        read_lora_deltas(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MergeCheckError, match="no \\*.safetensors checkpoint"):
        compare_merged_weights(merged_case["base"], tmp_path / "empty", merged_case["adapter"])


def test_merged_checkpoint_in_another_dtype_fails(merged_case) -> None:
    rewrite(merged_case["merged"], lambda tensors: tensors.update(
        {key: value.float() for key, value in tensors.items()}))
    report = compare_merged_weights(merged_case["base"], merged_case["merged"],
                                    merged_case["adapter"], dtype="bfloat16")
    assert not report.passed and not report.wrong
    assert "stored as ['float32'], not bfloat16" in report.detail()


def test_cast_floating_tensors_rewrites_a_float32_checkpoint(tmp_path: Path) -> None:
    from vlmrl.models.merged_weights import cast_floating_tensors

    weights = {"a.weight": torch.randn(4, 4), "b.ids": torch.arange(3)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"dtype": "float32", "text_config": {"dtype": "float32"}, "vision_config": {}}))

    assert cast_floating_tensors(tmp_path, "bfloat16") == ["model.safetensors"]
    cast = load_file(str(tmp_path / "model.safetensors"))
    assert cast["a.weight"].dtype == torch.bfloat16
    assert torch.equal(cast["a.weight"], weights["a.weight"].to(torch.bfloat16))
    assert torch.equal(cast["b.ids"], weights["b.ids"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == config["text_config"]["dtype"] == "bfloat16"
    assert "dtype" not in config["vision_config"]
    assert cast_floating_tensors(tmp_path, "bfloat16") == []  # already there
    assert not list(tmp_path.glob(".*.tmp"))


def test_merge_into_the_float32_checkpoint_passes(tmp_path: Path) -> None:
    """Unsloth merges into the checkpoint it loaded (float32 here) and the export casts the result
    to bfloat16, while the base it is checked against was saved in bfloat16: two roundings, and
    where W + delta nearly cancels they are many steps of the result's own size."""
    torch.manual_seed(0)
    weight = torch.randn(256, 128) * 0.02
    a, b = torch.rand(4, 128) * 0.04 - 0.02, torch.randn(256, 4) * 0.01
    weight[0, :4] = -(b @ a)[0, :4]  # exact cancellation in float32
    for name, tensors in (("base", {Q: weight.to(torch.bfloat16)}),
                          ("merged", {Q: (weight + 2.0 * (b @ a)).to(torch.bfloat16)})):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    (tmp_path / "adapter").mkdir()
    save_file({f"base_model.model.{Q[:-len('.weight')]}.lora_A.weight": a,
               f"base_model.model.{Q[:-len('.weight')]}.lora_B.weight": b},
              str(tmp_path / "adapter" / "adapter_model.safetensors"))
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))

    report = compare_merged_weights(tmp_path / "base", tmp_path / "merged", tmp_path / "adapter",
                                    dtype="bfloat16")
    assert report.passed, report.detail()
    assert report.max_ulps <= 2.0
    unmerged = compare_merged_weights(tmp_path / "base", tmp_path / "base", tmp_path / "adapter")
    assert not unmerged.passed and unmerged.max_ulps > 10
