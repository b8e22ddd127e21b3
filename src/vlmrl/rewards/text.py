"""Free-text answers (a caption, a summary, a competition's written answer) are right by degree,
not exactly, so teams reward them with the competition's own metric. These rewards compare the
SOLUTION block with the gold answer, so the format stays part of the task: a completion without a
SOLUTION block scores 0, and a record without a gold text gives no signal (None).

ROUGE comes from Google's `rouge-score` package (imported on first use: the reward playground and
the CLI import `vlmrl.rewards.functions` and should not pay for nltk). The BERTScore-style reward needs a
model, so it lives on the models floor (`vlmrl.models.similarity`) and is registered by name."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from vlmrl.rewards import scoring
from vlmrl.rewards.answer_format import DEFAULT_FORMAT, AnswerFormat

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


@functools.cache
def _rouge_scorer(rouge_type: str, use_stemmer: bool):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type], use_stemmer=use_stemmer)


def solution_and_gold(completions: Sequence[str], answer: Sequence[Any] | None,
                      fmt: AnswerFormat = DEFAULT_FORMAT) -> list[tuple[str | None, str | None]]:
    """(the SOLUTION block's text or None, the gold text or None) per completion."""
    if answer is None:
        raise ValueError("this reward needs an 'answer' column")
    if len(answer) != len(completions):
        raise ValueError(f"column 'answer' has {len(answer)} values for {len(completions)} "
                         "completions")
    golds = [None if gold is None or not str(gold).strip() else str(gold) for gold in answer]
    return [(scoring.extract_solution(text, fmt), gold) for text, gold in zip(completions, golds)]


def rouge_values(texts: Sequence[str], answer: Sequence[Any] | None, rouge_type: str,
                 use_stemmer: bool, fmt: AnswerFormat = DEFAULT_FORMAT) -> list[float | None]:
    if rouge_type not in ROUGE_TYPES:
        raise ValueError(f"rouge_reward: rouge_type {rouge_type!r} is not one of "
                         f"{', '.join(ROUGE_TYPES)}")
    scorer = _rouge_scorer(rouge_type, use_stemmer)
    values: list[float | None] = []
    for solution, gold in solution_and_gold(texts, answer, fmt):
        if gold is None:
            values.append(None)
        elif not solution:
            values.append(0.0)
        else:
            values.append(scorer.score(gold, solution)[rouge_type].fmeasure)
    return values
