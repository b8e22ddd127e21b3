"""The embedded default model: real Qwen3-VL classes, Qwen's special tokens wired into the
config, the real chat template, a processor without torchvision, deterministic weights."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from vlmrl.data.prompts import build_prompt
from vlmrl.models.embedded import (
    SHAPES,
    build_config,
    embedded_model_dir,
    ensure_embedded_model,
)
from vlmrl.models.loading import load_model
from vlmrl.models.processor import suppressed_generation_kwargs, vision_token_ids
from vlmrl.params import ModelParams

NAME = "embedded:tiny-qwen3-vl"


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelParams(name=NAME))


def test_config_points_at_qwen_special_tokens(tiny) -> None:
    model, processor, backend = tiny
    tokenizer = processor.tokenizer
    config = model.config
    assert backend == "transformers"
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    for token, token_id in (("<|image_pad|>", config.image_token_id),
                            ("<|vision_start|>", config.vision_start_token_id),
                            ("<|vision_end|>", config.vision_end_token_id),
                            ("<|video_pad|>", config.video_token_id),
                            ("<|im_end|>", config.text_config.eos_token_id)):
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 151644
    assert config.text_config.hidden_size % 256 == 0  # llama.cpp K-quants need 256-wide rows
    assert config.tie_word_embeddings


def test_real_qwen3_tokenizer(tiny) -> None:
    tokenizer = tiny[1].tokenizer
    # Qwen3's vocabulary: 151,643 BPE tokens plus the special ones.
    assert len(tokenizer) == 151669
    assert tokenizer.decode(tokenizer.encode("The area is 12.5 cm²")) == "The area is 12.5 cm²"


def test_chat_template_places_one_image(tiny) -> None:
    processor = tiny[1]
    record = {"question": "What is the value of the tallest bar?", "question_type": "free_form",
              "answer_type": "integer"}
    text = processor.apply_chat_template(build_prompt(record), add_generation_prompt=True,
                                         tokenize=False)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_generates_from_an_image_and_a_question(tiny) -> None:
    model, processor, _ = tiny
    record = {"question": "How many bars are there?", "question_type": "free_form",
              "answer_type": "integer"}
    text = processor.apply_chat_template(build_prompt(record), add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=[text], images=[[Image.new("RGB", (512, 384), "white")]],
                       return_tensors="pt")
    assert inputs["pixel_values"].shape[0] > 0
    image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert image_tokens == int(inputs["image_grid_thw"].prod()) // 4
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False,
                            **suppressed_generation_kwargs(processor))
    new_tokens = output[0, inputs["input_ids"].shape[1]:]
    assert len(new_tokens) == 8
    assert not set(new_tokens.tolist()) & set(vision_token_ids(processor))


def test_same_seed_same_weights() -> None:
    from safetensors.torch import load_file

    first = load_file(str(ensure_embedded_model(NAME, seed=0) / "model.safetensors"))
    config = build_config(SHAPES["tiny-qwen3-vl"])
    torch.manual_seed(0)
    from transformers import Qwen3VLForConditionalGeneration

    rebuilt = Qwen3VLForConditionalGeneration(config).state_dict()
    rebuilt["model.language_model.norm.weight"].fill_(SHAPES["tiny-qwen3-vl"].output_norm_scale)
    assert SHAPES["tiny-qwen3-vl"].output_norm_scale == 6.0  # lifts the logit ceiling
    for name, tensor in first.items():
        assert torch.equal(tensor, rebuilt[name]), name
    assert embedded_model_dir(NAME, 0) != embedded_model_dir(NAME, 1)


def test_saved_like_a_hub_repo() -> None:
    directory = ensure_embedded_model(NAME, seed=0)
    preprocessor = json.loads((directory / "preprocessor_config.json").read_text())
    assert preprocessor["processor_class"] == "Qwen3VLProcessor"
    assert (directory / "chat_template.jinja").read_text().count("<|vision_start|>") >= 1
    assert (directory / "tokenizer.json").is_file()


def test_unknown_embedded_name() -> None:
    with pytest.raises(ValueError, match="embedded:tiny-qwen3-vl"):
        ensure_embedded_model("embedded:huge")


def test_8b_shape_is_qwen3_vl_8b() -> None:
    """Qwen3-VL-8B-Instruct's published config, and its 8.77 B parameters (counted on the meta
    device: nothing is allocated)."""
    from transformers import Qwen3VLForConditionalGeneration

    config = build_config(SHAPES["qwen3-vl-8b-shape"])
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.head_dim, text.intermediate_size) == (
        4096, 36, 32, 8, 128, 12288)
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.out_hidden_size,
            list(vision.deepstack_visual_indexes)) == (27, 1152, 4304, 4096, [8, 16, 24])
    assert config.tie_word_embeddings is False and text.tie_word_embeddings is False
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.77


def test_fields_added_later_keep_existing_cache_dirs() -> None:
    from vlmrl.models.embedded import _identity

    assert set(_identity(SHAPES["qwen3-vl-2b-shape"])) == {"text", "vision", "max_pixels",
                                                          "min_pixels", "mrope_section"}
    # the tiny shape sets a later field, so its weights (and cache directory) did change
    assert _identity(SHAPES["tiny-qwen3-vl"])["output_norm_scale"] == 6.0
    assert _identity(SHAPES["qwen3-vl-8b-shape"])["saved_dtype"] == "bfloat16"


def test_untied_shape_saved_in_bf16(tmp_path) -> None:
    """The 8B shape's two switches, on the tiny shape: a separate lm_head, bf16 on disk."""
    from dataclasses import replace

    from safetensors import safe_open

    from vlmrl.models.embedded import build_model

    shape = replace(SHAPES["tiny-qwen3-vl"], tie_word_embeddings=False, saved_dtype="bfloat16")
    build_model(shape, seed=0, out_dir=tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        dtypes = {weights.get_slice(name).get_dtype() for name in names}
        head = weights.get_tensor("lm_head.weight")
        embed = weights.get_tensor("model.language_model.embed_tokens.weight")
    assert dtypes == {"BF16"}
    assert not torch.equal(head, embed)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
