"""A BERTScore-style reward for free-text answers: the F1 of greedy cosine matching between the
contextual token embeddings of the SOLUTION block and of the gold answer (Zhang et al., 2020,
without idf weighting or baseline rescaling). It takes any model id `AutoModel` loads, so it runs
wherever the hub is reachable (or on a local model directory); nothing here downloads by itself,
and the embedded default never names it. On the models floor because it needs torch; the
rewards registry reaches it by name (`bertscore_reward`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModel, AutoTokenizer

from vlmrl.rewards.answer_format import DEFAULT_FORMAT, AnswerFormat
from vlmrl.rewards.text import solution_and_gold


@functools.lru_cache(maxsize=2)
def _encoder(model: str, device: str):
    tokenizer = AutoTokenizer.from_pretrained(model)
    encoder = AutoModel.from_pretrained(model).to(device).eval()
    return tokenizer, encoder


def token_embeddings(texts: Sequence[str], model: str, layer: int | None,
                     device: str) -> list[torch.Tensor]:
    """L2-normalised embeddings of each text's tokens, special tokens left out."""
    tokenizer, encoder = _encoder(model, device)
    encoded = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True,
                        return_special_tokens_mask=True).to(device)
    special = encoded.pop("special_tokens_mask").bool()
    with torch.inference_mode():
        output = encoder(**encoded, output_hidden_states=layer is not None)
    states = output.last_hidden_state if layer is None else output.hidden_states[layer]
    keep = encoded["attention_mask"].bool() & ~special
    return [torch.nn.functional.normalize(row[mask].float(), dim=-1)
            for row, mask in zip(states, keep)]


def greedy_f1(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    if not len(candidate) or not len(reference):
        return 0.0
    similarity = candidate @ reference.T
    precision = similarity.max(dim=1).values.mean().item()
    recall = similarity.max(dim=0).values.mean().item()
    return 0.0 if precision + recall <= 0 else 2 * precision * recall / (precision + recall)


def bertscore_reward(completions: Sequence[Any], *, model: str, layer: int | None = None,
                     device: str = "cpu", answer_format: AnswerFormat = DEFAULT_FORMAT,
                     **columns: Any) -> list[float | None]:
    """BERTScore-style F1 of the SOLUTION block against the gold answer, with `model`'s
    embeddings (`layer`: a hidden-state index, default the last); 0 without a SOLUTION block,
    None without a gold text."""
    from vlmrl.rewards.functions import completion_text

    pairs = solution_and_gold([completion_text(c) for c in completions], columns.get("answer"),
                              answer_format)
    scored = [i for i, (solution, gold) in enumerate(pairs) if solution and gold]
    values: list[float | None] = [None if gold is None else 0.0 for _, gold in pairs]
    if scored:
        candidates = token_embeddings([pairs[i][0] for i in scored], model, layer, device)
        references = token_embeddings([pairs[i][1] for i in scored], model, layer, device)
        for i, candidate, reference in zip(scored, candidates, references):
            values[i] = greedy_f1(candidate, reference)
    return values
