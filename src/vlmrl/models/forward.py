"""The fixed input and the logits that verify_lora and export compare: the first eval row's
image and question as evaluation builds them, or its question alone as chat-template text (what
llama.cpp is fed), run through a model in float32 on the CPU so that two models' logits can be
compared number by number. Both stages import it from here, so neither imports the other."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import load_from_disk

from vlmrl.models.backend import model_device
from vlmrl.models.processor import message_text, model_inputs, render_chat, tokenizer_of


def first_eval_row(eval_set: Path | str) -> dict[str, Any]:
    eval_set = Path(eval_set)
    if not (eval_set / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{eval_set}: no prepared eval set there; the prepare_data stage "
                                "makes it (dvc repro prepare_data)")
    dataset = load_from_disk(str(eval_set))
    if len(dataset) == 0:
        raise ValueError(f"{eval_set}: the eval set is empty")
    return dataset[0]


def question_inputs(processor, row: Mapping[str, Any]):
    """Model inputs (batch of one) for the row's image (if it has one) and question, as
    evaluation builds them."""
    image = row.get("image")
    return model_inputs(processor, [render_chat(processor, row["prompt"])],
                        None if image is None else [image])


def forward_logits(model, inputs) -> torch.Tensor:
    """Float32 logits of every position, on the CPU."""
    with torch.no_grad():
        output = model(**inputs.to(model_device(model)))
    return output.logits.float().cpu()


def adapter_and_base_logits(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits of the PEFT model with its adapter, and with the adapter switched off."""
    adapter_logits = forward_logits(model, inputs)
    with model.disable_adapter():
        base_logits = forward_logits(model, inputs)
    return adapter_logits, base_logits


def text_prompt(processor, row: Mapping) -> tuple[str, list[int]]:
    """The row's question without its image, as chat-template text and its token ids; llama.cpp
    is fed these very ids, so both models see identical tokens."""
    messages = [{"role": message["role"], "content": message_text(message["content"])}
                for message in row["prompt"]]
    tokenizer = tokenizer_of(processor)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def hf_last_logits(model, token_ids: Sequence[int]) -> np.ndarray:
    with torch.no_grad():
        ids = torch.tensor([list(token_ids)], device=model_device(model))
        return model(input_ids=ids).logits[0, -1].float().cpu().numpy()


def max_abs_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf
    return float(np.abs(a - b).max())
