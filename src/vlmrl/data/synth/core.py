"""What every item kind shares: the `Problem` a builder returns, the `Kind` a kind module
exports, the answer helpers that keep answers exact, and the assembly of MathVista's record.

Why this exists: the four kinds differ only in their data, questions and drawing; the record
layout, the query text and the rule that a float answer is never a tie must be written once, so
that a kind cannot drift from MathVista's schema on its own.

Deliberate choices:
- This module knows no kind by name: `vlmrl.data.synth` holds the one table of kinds, so kind
  modules import this one and never each other.
- A builder may return None (a tie, no threshold between the values); `build` then draws again
  from the same generator, so the retries are part of record i's deterministic stream.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from PIL import Image, ImageDraw

ANSWER_FORMATS = ("integer", "float", "multi_choice")
ANSWER_FORMAT_WEIGHTS = (50, 20, 30)
MAX_ATTEMPTS = 200

HINTS = {
    "integer": "Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end.",
    "float1": "Hint: Please answer the question requiring a floating-point number with one decimal place and provide the final value, e.g., 1.2, 1.3, 1.4, at the end.",
    "float2": "Hint: Please answer the question requiring a floating-point number with two decimal places and provide the final value, e.g., 1.23, 1.34, 1.45, at the end.",
    "multi_choice": "Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.",
}

STATISTICS = ("statistical reasoning",)
ARITHMETIC_STATISTICS = ("arithmetic reasoning", "statistical reasoning")
GEOMETRY_ALGEBRA = ("geometry reasoning", "algebraic reasoning")
GEOMETRY_ARITHMETIC = ("geometry reasoning", "arithmetic reasoning")


@dataclass(frozen=True)
class Problem:
    """One question about one drawing; `synth` is everything the drawing shows."""

    synth: dict[str, Any]
    question: str
    answer: str
    answer_type: str  # "integer" | "float" | "text"
    skills: tuple[str, ...]
    precision: int | None = None
    choices: list[str] | None = None
    unit: str | None = None


Builder = Callable[[random.Random], Problem | None]
Drawer = Callable[[ImageDraw.ImageDraw, dict[str, Any], int], None]


@dataclass(frozen=True)
class Kind:
    """One item kind: its MathVista context, a builder per answer format, and its drawing."""

    name: str
    context: tuple[str, str, str]  # (context, task, grade) in MathVista's metadata
    builders: Mapping[str, Builder]  # answer format -> builder
    draw: Drawer
    tier: str  # difficulty tier for reports: "read" < "chart", "geometry"
    pid_prefix: str = "synth"


def build(kind: Kind, answer_format: str, rng: random.Random) -> Problem:
    """A problem of `kind` in `answer_format`, drawing again from the same `rng` while the builder
    returns None (a tie, no threshold), at most MAX_ATTEMPTS times."""
    builder = kind.builders[answer_format]
    for _ in range(MAX_ATTEMPTS):
        problem = builder(rng)
        if problem is not None:
            return problem
    raise RuntimeError(f"no {kind.name} {answer_format} problem after {MAX_ATTEMPTS} attempts")


def assemble_record(
    kind: Kind,
    index: int,
    answer_format: str,
    problem: Problem,
    image: Image.Image,
    image_size: int,
) -> dict[str, Any]:
    """Record `index` in MathVista's layout (plus its `query` column)."""
    context, task, grade = kind.context
    question_type = "multi_choice" if answer_format == "multi_choice" else "free_form"
    return {
        "pid": f"{kind.pid_prefix}-{index:05d}",
        "question": problem.question,
        "image": image,
        "choices": problem.choices,
        "unit": problem.unit,
        "precision": None if problem.precision is None else float(problem.precision),
        "answer": problem.answer,
        "question_type": question_type,
        "answer_type": problem.answer_type,
        "query": query(problem),
        "metadata": {
            "split": "synthetic",
            "language": "english",
            "img_width": image_size,
            "img_height": image_size,
            "source": f"vlmrl-synth-{kind.name}",
            "category": "math-targeted-vqa",
            "task": task,
            "context": context,
            "grade": grade,
            "skills": list(problem.skills),
            # the tier sits in `synth`: the metadata keys stay exactly MathVista's plus `synth`
            "synth": {**problem.synth, "tier": kind.tier},
        },
    }


def query(problem: Problem) -> str:
    """MathVista's `query` column, as its build_query.py writes it for zero-shot solutions."""
    if problem.choices:
        hint = HINTS["multi_choice"]
    elif problem.answer_type == "float":
        hint = HINTS[f"float{problem.precision}"]
    else:
        hint = HINTS["integer"]
    question = f"Question: {problem.question}"
    if problem.unit:
        question += f" (Unit: {problem.unit})"
    lines = [hint, question]
    if problem.choices:
        lines.append("Choices:")
        lines += [f"({chr(ord('A') + i)}) {choice}" for i, choice in enumerate(problem.choices)]
    return "\n".join(lines)


# --------------------------------------------------------------- answer helpers


def format_float(value: Fraction | float, precision: int) -> str | None:
    """`value` rounded to `precision` decimals; None for a tie or a trailing 0 (see vlmrl.data.synth)."""
    scaled = Fraction(value) * 10**precision
    whole, rest = divmod(scaled, 1)
    if abs(rest - Fraction(1, 2)) < Fraction(1, 10**6) or scaled < 1:
        return None
    digits = int(whole) + (1 if rest > Fraction(1, 2) else 0)
    if digits % 10 == 0:
        return None
    text = str(digits).rjust(precision + 1, "0")
    return f"{text[:-precision]}.{text[-precision:]}"


def integer_problem(
    synth: dict[str, Any],
    question: str,
    value: int,
    skills: tuple[str, ...],
    unit: str | None = None,
) -> Problem:
    """A question whose gold answer is the integer `value`."""
    return Problem(synth, question, str(value), "integer", skills, unit=unit)


def float_problem(
    synth: dict[str, Any],
    question: str,
    value: Fraction | float,
    precision: int,
    skills: tuple[str, ...],
    unit: str | None = None,
) -> Problem | None:
    """A question whose gold answer is `value` rounded to `precision` decimals; None where that
    rounding is a tie or ends in 0 (`format_float`), so the builder draws again."""
    answer = format_float(value, precision)
    if answer is None:
        return None
    synth = {**synth, "precision": precision}
    return Problem(synth, question, answer, "float", skills, precision=precision, unit=unit)


def text_choices(rng: random.Random, answer: str, pool: Sequence[str]) -> list[str]:
    """Four choices in a random order: `answer` and three others from `pool`."""
    choices = rng.sample([item for item in pool if item != answer], 3) + [answer]
    rng.shuffle(choices)
    return choices


def extreme_index(template: str, values: Sequence[int]) -> int:
    """Where the largest ("argmax") or else the smallest of the distinct `values` stands."""
    return values.index(max(values) if template == "argmax" else min(values))


def threshold_between(rng: random.Random, values: Sequence[int]) -> int | None:
    """A round number strictly between min and max of `values` that is none of them."""
    candidates = [t for t in range(min(values) + 1, max(values)) if t % 5 == 0 and t not in values]
    return rng.choice(candidates) if candidates else None


def distinct_values(rng: random.Random, count: int, low: int, high: int) -> list[int]:
    """`count` different integers from `low` to `high` (both included), in random order."""
    return rng.sample(range(low, high + 1), count)


def article(noun: str) -> str:
    """The indefinite article before `noun` ("an age", "a score")."""
    return "an" if noun[0] in "aeiou" else "a"


def mean(values: Sequence[int]) -> Fraction:
    """The exact mean of `values`, so that rounding happens once, in `format_float`."""
    return Fraction(sum(values), len(values))
