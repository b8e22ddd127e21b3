"""Training and evaluation must show the model the same prompt, and a multiple-choice question
is unanswerable without its options, so one module builds every prompt from a MathVista row."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vlmrl.rewards.answer_format import DEFAULT_FORMAT

# The default answer format's; a run's own is params.yaml `answer_format.system_prompt`.
SYSTEM_PROMPT = DEFAULT_FORMAT.system_text()

_ANSWER_HINTS = {
    "integer": "Answer with an integer, e.g. 1, 2, 3.",
    "list": "Answer with a Python list, e.g. [1, 2, 3].",
    "text": "Answer with the option letter, e.g. A, B, C, D.",
}


def answer_hint(record: Mapping[str, Any]) -> str:
    if record.get("question_type") == "multi_choice":
        return _ANSWER_HINTS["text"]
    answer_type = record.get("answer_type")
    if answer_type == "float":
        decimals = int(record.get("precision") or 1)
        example = ", ".join(f"{1 + i * 0.11:.{decimals}f}" for i in range(3))
        places = "one decimal place" if decimals == 1 else f"{decimals} decimal places"
        return f"Answer with a number with {places}, e.g. {example}."
    return _ANSWER_HINTS.get(str(answer_type), "Answer with the final value.")


def format_choices(choices: Sequence[str] | None) -> str:
    if not choices:
        return ""
    lines = [f"({chr(ord('A') + index)}) {choice}" for index, choice in enumerate(choices)]
    return "Choices:\n" + "\n".join(lines)


def question_text(record: Mapping[str, Any]) -> str:
    question = str(record["question"]).strip()
    unit = record.get("unit")
    if unit:
        question += f" (Unit: {unit})"
    parts = [question]
    if record.get("question_type") == "multi_choice":
        parts.append(format_choices(record.get("choices")))
    parts.append(answer_hint(record))
    return "\n".join(part for part in parts if part)


def prompt_question(prompt: Any) -> str | None:
    """The text of the user message of a conversational prompt (what `build_prompt` put there)."""
    for message in prompt or []:
        if isinstance(message, Mapping) and message.get("role") == "user":
            parts = message.get("content") or []
            return "\n".join(p.get("text") or "" for p in parts
                             if isinstance(p, Mapping) and p.get("type") == "text") or None
    return None


def build_prompt(record: Mapping[str, Any], system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """Conversational prompt with an image placeholder, as GRPOTrainer and the chat template
    expect; the image itself travels in the row's `image` column."""
    return [
        {"role": "system", "content": [{"type": "text", "text": system_prompt}]},
        {"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": question_text(record)}]},
    ]
