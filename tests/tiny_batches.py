"""A GRPO-shaped batch for the tiny Qwen3-VL: two left-padded prompts with images of different
sizes, then completions whose second is right-padded; and the tiny Qwen3-VL with a LoRA
adapter, as the tests that train or score it load it."""

from __future__ import annotations

import torch
from PIL import Image


def padded_vl_batch(processor) -> dict[str, torch.Tensor]:
    processor.tokenizer.padding_side = "left"
    texts = [processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True, tokenize=False)
        for question in ("What is 2 + 2?", "Name the largest value in the chart, please.")]
    images = [Image.new("RGB", (64 + 32 * i, 64), (40 * i, 90, 200)) for i in range(2)]
    batch = dict(processor(text=texts, images=images, return_tensors="pt", padding=True))
    completion = torch.randint(10, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    completion_mask = torch.ones(2, 9, dtype=torch.long)
    completion_mask[1, 5:] = 0
    batch = with_completions(batch, completion, completion_mask)
    assert (batch["attention_mask"][:, 0] == 0).any()
    return batch


def with_completions(batch: dict[str, torch.Tensor], completion: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """`batch` with `completion` after each row's ids (`mask`: which of them are real), as text."""
    longer = {**batch, "input_ids": torch.cat([batch["input_ids"], completion], 1),
              "attention_mask": torch.cat([batch["attention_mask"], mask], 1)}
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in batch:
            longer[key] = torch.cat([batch[key], torch.zeros_like(completion)], 1)
    return longer


def tiny_lora_policy(dtype: torch.dtype, seed: int = 0):
    """The tiny Qwen3-VL in `dtype` with a random LoRA adapter on q_proj and v_proj, and its
    processor."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.embedded import ensure_embedded_model
    from vlmrl.models.processor import load_processor

    path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=seed)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                             target_modules=["q_proj", "v_proj"]))
    return model, load_processor(str(path))
