"""`vlmrl.training.trainer.pixel_values` on the tiny Qwen3-VL: the model casts pixel values to its vision
tower's dtype first, so a bfloat16 policy gives the same logits from pixel values kept in
bfloat16 as from the processor's float32; the GRPO subclass keeps a generation batch's that way,
and leaves other models' and other fields alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_batches import padded_vl_batch, tiny_lora_policy

from vlmrl.training.trainer.mixins import PixelValuesInTowerDtype
from vlmrl.training.trainer.pixel_values import pixels_in, tower_dtype


@pytest.fixture(scope="module")
def tiny_bf16():
    model, processor = tiny_lora_policy(torch.bfloat16)
    return model.eval(), processor


def test_bfloat16_pixel_values_give_the_float32_ones_logits(tiny_bf16) -> None:
    model, processor = tiny_bf16
    inputs = padded_vl_batch(processor)
    assert inputs["pixel_values"].dtype == torch.float32
    kept = pixels_in(inputs, tower_dtype(model))
    assert kept["pixel_values"].dtype == torch.bfloat16
    assert kept["input_ids"] is inputs["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(**kept).logits, model(**inputs).logits)


def test_the_tower_dtype_is_known_for_casting_models_only(tiny_bf16) -> None:
    model, _ = tiny_bf16
    assert tower_dtype(model) == tower_dtype(model.get_base_model()) == torch.bfloat16
    assert tower_dtype(torch.nn.Linear(2, 2)) is None
    other = SimpleNamespace(config=SimpleNamespace(model_type="llava"),
                            model=SimpleNamespace(visual=torch.nn.Linear(2, 2)))
    assert tower_dtype(other) is None


def test_other_fields_and_dtypes_are_left_as_they_are() -> None:
    ids = {"prompt_ids": torch.ones(2, 3, dtype=torch.long)}
    assert pixels_in(ids, torch.bfloat16) is ids
    pixels = {"pixel_values": torch.ones(4, 6)}
    assert pixels_in(pixels, None) is pixels
    assert pixels_in(pixels, torch.float32) is pixels
    assert pixels_in(pixels, torch.bfloat16)["pixel_values"].dtype == torch.bfloat16


def test_the_grpo_subclass_keeps_a_generation_batchs_pixels_in_the_towers_dtype(tiny_bf16):
    class Generation:
        def _generate_and_score_completions(self, inputs):
            return {"pixel_values": torch.ones(4, 6), "completion_ids": torch.ones(2, 3)}

    class Trainer(PixelValuesInTowerDtype, Generation):
        model = tiny_bf16[0]

    output = Trainer()._generate_and_score_completions([])
    assert output["pixel_values"].dtype == torch.bfloat16
    assert output["completion_ids"].dtype == torch.float32
