"""Synthetic visual maths problems in MathVista's schema, rendered with Pillow.

Why this exists: the pipeline must still train, evaluate and be tested on
machines that cannot reach the Hugging Face hub, so the project renders its own
stand-in for MathVista: bar charts, line plots, tables and simple geometry with
integer, float and multiple-choice questions, in exactly MathVista's record
layout (plus its `query` column), so every consumer reads both the same way.

Deliberate choices:
- Every answer is computed from the very numbers that are drawn, which are kept
  in `metadata["synth"]`; `render(synth, size)` redraws the image from them
  alone. A reward must never train the policy against an answer the picture
  does not support.
- Record i depends only on (seed, i): a set can be regenerated anywhere instead
  of shipped, and `generate(10, s)[:5] == generate(5, s)`. Only Pillow's bundled
  font is used, so the pixels do not depend on the machine's fonts.
- Float answers are never ties and never end in 0: `str(round(float(a), p))`,
  MathVista's own float normalisation, gives the gold string back, and nobody
  has to guess which way a half rounds.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

__all__ = ["KINDS", "format_float", "generate", "render", "save"]

KINDS = ("bar", "line", "table", "geometry")
ANSWER_FORMATS = ("integer", "float", "multi_choice")
ANSWER_FORMAT_WEIGHTS = (50, 20, 30)
PI_AS_STATED = 3.14159
MAX_ATTEMPTS = 200

BACKGROUND = (255, 255, 255)
INK = (33, 33, 33)
GRID = (225, 225, 225)
HEADER_FILL = (214, 228, 247)
PALETTE = (
    (66, 133, 244),
    (219, 68, 55),
    (244, 160, 0),
    (15, 157, 88),
    (142, 68, 173),
    (0, 150, 170),
)

CONTEXTS = {
    "bar": ("bar chart", "figure question answering", "not applicable"),
    "line": ("line plot", "figure question answering", "not applicable"),
    "table": ("table", "math word problem", "elementary school"),
    "geometry": ("geometry diagram", "geometry problem solving", "high school"),
}

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


@dataclass(frozen=True)
class TableTheme:
    title: str
    entity_header: str
    measure_header: str
    measure: str
    plural: str
    unit: str | None
    value_range: tuple[int, int]
    names: tuple[str, ...]
    total_question: str
    most_question: str
    least_question: str


@dataclass(frozen=True)
class LineTheme:
    title: str
    measure: str
    unit: str | None
    x_name: str = "year"  # "year" or "x"


@dataclass(frozen=True)
class BarTheme:
    title: str
    labels: tuple[str, ...]
    keep_order: bool = False  # months and letters keep their natural order


BAR_THEMES = (
    BarTheme(
        "Fruit sold at a market",
        ("Apple", "Banana", "Cherry", "Grape", "Mango", "Orange", "Pear", "Plum"),
    ),
    BarTheme(
        "Books read each month",
        ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug"),
        keep_order=True,
    ),
    BarTheme(
        "Votes for class president", ("Ava", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana")
    ),
    BarTheme(
        "Cars in a car park by colour", ("Red", "Blue", "Green", "Black", "White", "Silver", "Grey")
    ),
    BarTheme("Survey answers", ("A", "B", "C", "D", "E", "F", "G"), keep_order=True),
)

LINE_THEMES = (
    LineTheme("Books sold by a shop", "number of books sold", None),
    LineTheme("Rainfall in June", "rainfall", "mm"),
    LineTheme("Members of a chess club", "number of members", None),
    LineTheme("Price of a concert ticket", "ticket price", "dollars"),
    LineTheme("Measured values of y", "y value", None, x_name="x"),
)

PEOPLE = ("Alice", "Bruno", "Chen", "Dara", "Emil", "Farah", "Greta", "Hugo", "Ines", "Jonas")
TABLE_THEMES = (
    TableTheme(
        "Ages of family members",
        "Name",
        "Age (years)",
        "age",
        "family members",
        "years",
        (4, 90),
        PEOPLE,
        "What is the total age of all the family members?",
        "Who is the oldest?",
        "Who is the youngest?",
    ),
    TableTheme(
        "Heights of plants",
        "Plant",
        "Height (cm)",
        "height",
        "plants",
        "cm",
        (5, 150),
        ("Basil", "Fern", "Ivy", "Mint", "Orchid", "Rose", "Sage", "Tulip"),
        "What is the total height of all the plants?",
        "Which plant is the tallest?",
        "Which plant is the shortest?",
    ),
    TableTheme(
        "Maths test scores",
        "Student",
        "Score",
        "score",
        "students",
        None,
        (35, 100),
        PEOPLE,
        "What is the total score of all the students?",
        "Which student has the highest score?",
        "Which student has the lowest score?",
    ),
    TableTheme(
        "Distance run in a week",
        "Runner",
        "Distance (km)",
        "distance",
        "runners",
        "km",
        (3, 60),
        PEOPLE,
        "What is the total distance run by all the runners?",
        "Which runner ran the longest distance?",
        "Which runner ran the shortest distance?",
    ),
    TableTheme(
        "Weights of parcels",
        "Parcel",
        "Weight (kg)",
        "weight",
        "parcels",
        "kg",
        (1, 45),
        ("Parcel A", "Parcel B", "Parcel C", "Parcel D", "Parcel E", "Parcel F", "Parcel G"),
        "What is the total weight of all the parcels?",
        "Which parcel is the heaviest?",
        "Which parcel is the lightest?",
    ),
)

PYTHAGOREAN_TRIPLES = tuple(
    (a, b, math.isqrt(a * a + b * b))
    for a in range(3, 41)
    for b in range(a + 1, 41)
    if math.isqrt(a * a + b * b) ** 2 == a * a + b * b
)


# ------------------------------------------------------------------ public API


def generate(n: int, seed: int = 0, image_size: int = 512) -> list[dict[str, Any]]:
    """`n` MathVista-schema records with rendered RGB images of `image_size` pixels square."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if image_size < 64:
        raise ValueError(f"image_size must be at least 64, got {image_size}")
    return [_record(seed, index, image_size) for index in range(n)]


def save(records: Sequence[dict[str, Any]], directory: str | Path) -> None:
    """Write `directory/images/{pid}.png` and `directory/data.jsonl` (images as relative paths)."""
    root = Path(directory)
    (root / "images").mkdir(parents=True, exist_ok=True)
    with open(root / "data.jsonl", "w", encoding="utf-8") as rows:
        for record in records:
            relative_path = f"images/{record['pid']}.png"
            record["image"].save(root / relative_path, format="PNG")
            row = {**record, "image": relative_path}
            rows.write(json.dumps(row, ensure_ascii=False) + "\n")


def render(synth: dict[str, Any], image_size: int = 512) -> Image.Image:
    """Draw the figure described by `synth` (a record's `metadata["synth"]`)."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    RENDERERS[synth["kind"]](ImageDraw.Draw(image), synth, image_size)
    return image


# --------------------------------------------------------------------- records


def _record(seed: int, index: int, image_size: int) -> dict[str, Any]:
    rng = random.Random(f"vlmrl.synth:{seed}:{index}")
    kind = KINDS[index % len(KINDS)]
    answer_format = rng.choices(ANSWER_FORMATS, weights=ANSWER_FORMAT_WEIGHTS)[0]
    problem = _build(kind, answer_format, rng)
    context, task, grade = CONTEXTS[kind]
    question_type = "multi_choice" if answer_format == "multi_choice" else "free_form"
    return {
        "pid": f"synth-{index:05d}",
        "question": problem.question,
        "image": render(problem.synth, image_size),
        "choices": problem.choices,
        "unit": problem.unit,
        "precision": None if problem.precision is None else float(problem.precision),
        "answer": problem.answer,
        "question_type": question_type,
        "answer_type": problem.answer_type,
        "query": _query(problem),
        "metadata": {
            "split": "synthetic",
            "language": "english",
            "img_width": image_size,
            "img_height": image_size,
            "source": f"vlmrl-synth-{kind}",
            "category": "math-targeted-vqa",
            "task": task,
            "context": context,
            "grade": grade,
            "skills": list(problem.skills),
            "synth": problem.synth,
        },
    }


def _query(problem: Problem) -> str:
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


def _build(kind: str, answer_format: str, rng: random.Random) -> Problem:
    builder = BUILDERS[kind][answer_format]
    for _ in range(MAX_ATTEMPTS):
        problem = builder(rng)
        if problem is not None:
            return problem
    raise RuntimeError(f"no {kind} {answer_format} problem after {MAX_ATTEMPTS} attempts")


# --------------------------------------------------------------- answer helpers


def format_float(value: Fraction | float, precision: int) -> str | None:
    """`value` rounded to `precision` decimals; None for a tie or a trailing 0 (see module doc)."""
    scaled = Fraction(value) * 10**precision
    whole, rest = divmod(scaled, 1)
    if abs(rest - Fraction(1, 2)) < Fraction(1, 10**6) or scaled < 1:
        return None
    digits = int(whole) + (1 if rest > Fraction(1, 2) else 0)
    if digits % 10 == 0:
        return None
    text = str(digits).rjust(precision + 1, "0")
    return f"{text[:-precision]}.{text[-precision:]}"


def _float_problem(
    synth: dict[str, Any],
    question: str,
    value: Fraction | float,
    precision: int,
    skills: tuple[str, ...],
    unit: str | None = None,
) -> Problem | None:
    answer = format_float(value, precision)
    if answer is None:
        return None
    synth = {**synth, "precision": precision}
    return Problem(synth, question, answer, "float", skills, precision=precision, unit=unit)


def _text_choices(rng: random.Random, answer: str, pool: Sequence[str]) -> list[str]:
    choices = rng.sample([item for item in pool if item != answer], 3) + [answer]
    rng.shuffle(choices)
    return choices


def _threshold_between(rng: random.Random, values: Sequence[int]) -> int | None:
    """A round number strictly between min and max of `values` that is none of them."""
    candidates = [t for t in range(min(values) + 1, max(values)) if t % 5 == 0 and t not in values]
    return rng.choice(candidates) if candidates else None


def _distinct_values(rng: random.Random, count: int, low: int, high: int) -> list[int]:
    return rng.sample(range(low, high + 1), count)


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def _mean(values: Sequence[int]) -> Fraction:
    return Fraction(sum(values), len(values))


# ------------------------------------------------------------------ bar charts


def _bar_data(rng: random.Random, template: str) -> dict[str, Any]:
    theme = rng.choice(BAR_THEMES)
    count = rng.randint(4, min(7, len(theme.labels)))
    labels = rng.sample(theme.labels, count)
    if theme.keep_order:
        labels.sort(key=theme.labels.index)
    values = _distinct_values(rng, count, 3, 95)
    color = rng.randrange(len(PALETTE))
    return {
        "kind": "bar",
        "title": theme.title,
        "labels": labels,
        "values": values,
        "color": color,
        "template": template,
    }


def _bar_integer(rng: random.Random) -> Problem | None:
    template = rng.choice(("max", "min", "sum_pair", "difference_pair", "total", "count_above"))
    synth = _bar_data(rng, template)
    labels, values = synth["labels"], synth["values"]
    first, second = rng.sample(range(len(labels)), 2)
    a, b = labels[first], labels[second]
    if template == "max":
        return Problem(
            synth, "What is the value of the tallest bar?", str(max(values)), "integer", STATISTICS
        )
    if template == "min":
        return Problem(
            synth, "What is the value of the shortest bar?", str(min(values)), "integer", STATISTICS
        )
    if template in ("sum_pair", "difference_pair"):
        synth["operands"] = [a, b]
        if template == "sum_pair":
            question, answer = (
                f"What is the sum of the values of {a} and {b}?",
                values[first] + values[second],
            )
        else:
            question, answer = (
                f"What is the difference between the values of {a} and {b}?",
                abs(values[first] - values[second]),
            )
        return Problem(synth, question, str(answer), "integer", ARITHMETIC_STATISTICS)
    if template == "total":
        return Problem(
            synth,
            "What is the sum of all the values in the chart?",
            str(sum(values)),
            "integer",
            ARITHMETIC_STATISTICS,
        )
    threshold = _threshold_between(rng, values)
    if threshold is None:
        return None
    synth["threshold"] = threshold
    answer = sum(value > threshold for value in values)
    return Problem(
        synth,
        f"How many bars have a value greater than {threshold}?",
        str(answer),
        "integer",
        STATISTICS,
    )


def _bar_float(rng: random.Random) -> Problem | None:
    template = rng.choice(("mean", "ratio"))
    synth = _bar_data(rng, template)
    labels, values = synth["labels"], synth["values"]
    if template == "mean":
        precision = rng.choice((1, 2))
        return _float_problem(
            synth,
            "What is the average of all the values in the chart?",
            _mean(values),
            precision,
            ARITHMETIC_STATISTICS,
        )
    first, second = rng.sample(range(len(labels)), 2)
    synth["operands"] = [labels[first], labels[second]]
    question = (
        f"What is the ratio of the value of {labels[first]} to the value of {labels[second]}?"
    )
    return _float_problem(
        synth, question, Fraction(values[first], values[second]), 2, ARITHMETIC_STATISTICS
    )


def _bar_choice(rng: random.Random) -> Problem | None:
    template = rng.choice(("argmax", "argmin"))
    synth = _bar_data(rng, template)
    labels, values = synth["labels"], synth["values"]
    pick = max if template == "argmax" else min
    answer = labels[values.index(pick(values))]
    adjective = "largest" if template == "argmax" else "smallest"
    return Problem(
        synth,
        f"Which category has the {adjective} value?",
        answer,
        "text",
        STATISTICS,
        choices=_text_choices(rng, answer, labels),
    )


# ------------------------------------------------------------------ line plots


def _line_data(rng: random.Random, template: str) -> dict[str, Any]:
    theme = rng.choice(LINE_THEMES)
    count = rng.randint(5, 8)
    start = rng.randint(2008, 2018) if theme.x_name == "year" else rng.randint(0, 2)
    values = _distinct_values(rng, count, 5, 95)
    return {
        "kind": "line",
        "title": theme.title,
        "measure": theme.measure,
        "unit": theme.unit,
        "x_name": theme.x_name,
        "x": list(range(start, start + count)),
        "y": values,
        "color": rng.randrange(len(PALETTE)),
        "template": template,
    }


def _at(synth: dict[str, Any], x: int) -> str:
    return f"in {x}" if synth["x_name"] == "year" else f"at x = {x}"


def _from_to(synth: dict[str, Any], x_from: int, x_to: int) -> str:
    if synth["x_name"] == "year":
        return f"from {x_from} to {x_to}"
    return f"from x = {x_from} to x = {x_to}"


def _rising_pair(rng: random.Random, ys: Sequence[int], min_gap: int) -> tuple[int, int] | None:
    pairs = [(i, j) for i in range(len(ys)) for j in range(i + min_gap, len(ys)) if ys[j] > ys[i]]
    return rng.choice(pairs) if pairs else None


def _line_integer(rng: random.Random) -> Problem | None:
    template = rng.choice(("value_at", "increase", "range"))
    synth = _line_data(rng, template)
    xs, ys, measure = synth["x"], synth["y"], synth["measure"]
    if template == "value_at":
        index = rng.randrange(len(xs))
        synth["operands"] = [xs[index]]
        return Problem(
            synth,
            f"What is the {measure} {_at(synth, xs[index])}?",
            str(ys[index]),
            "integer",
            STATISTICS,
            unit=synth["unit"],
        )
    if template == "range":
        question = f"What is the difference between the highest and the lowest {measure}?"
        return Problem(
            synth,
            question,
            str(max(ys) - min(ys)),
            "integer",
            ARITHMETIC_STATISTICS,
            unit=synth["unit"],
        )
    pair = _rising_pair(rng, ys, 1)
    if pair is None:
        return None
    i, j = pair
    synth["operands"] = [xs[i], xs[j]]
    question = f"By how much did the {measure} increase {_from_to(synth, xs[i], xs[j])}?"
    return Problem(
        synth, question, str(ys[j] - ys[i]), "integer", ARITHMETIC_STATISTICS, unit=synth["unit"]
    )


def _line_float(rng: random.Random) -> Problem | None:
    template = rng.choice(("mean_span", "rate"))
    synth = _line_data(rng, template)
    xs, ys, measure = synth["x"], synth["y"], synth["measure"]
    precision = rng.choice((1, 2))
    if template == "mean_span":
        i = rng.randrange(len(xs) - 2)
        j = rng.randrange(i + 2, len(xs))
        synth["operands"] = [xs[i], xs[j]]
        question = f"What is the average {measure} {_from_to(synth, xs[i], xs[j])}?"
        return _float_problem(
            synth,
            question,
            _mean(ys[i : j + 1]),
            precision,
            ARITHMETIC_STATISTICS,
            unit=synth["unit"],
        )
    pair = _rising_pair(rng, ys, 2)
    if pair is None:
        return None
    i, j = pair
    synth["operands"] = [xs[i], xs[j]]
    step = "year" if synth["x_name"] == "year" else "unit of x"
    question = (
        f"What is the average increase per {step} in the {measure} {_from_to(synth, xs[i], xs[j])}?"
    )
    return _float_problem(
        synth, question, Fraction(ys[j] - ys[i], j - i), precision, ARITHMETIC_STATISTICS
    )


def _line_choice(rng: random.Random) -> Problem | None:
    template = rng.choice(("argmax", "argmin"))
    synth = _line_data(rng, template)
    xs, ys = synth["x"], synth["y"]
    pick = max if template == "argmax" else min
    answer = xs[ys.index(pick(ys))]
    others = rng.sample([x for x in xs if x != answer], 3)
    choices = [str(x) for x in sorted(others + [answer])]
    which = "In which year" if synth["x_name"] == "year" else "At which x value"
    extreme = "highest" if template == "argmax" else "lowest"
    return Problem(
        synth,
        f"{which} was the {synth['measure']} the {extreme}?",
        str(answer),
        "text",
        STATISTICS,
        choices=choices,
    )


# ---------------------------------------------------------------------- tables


def _table_data(rng: random.Random, template: str) -> tuple[dict[str, Any], TableTheme]:
    theme = rng.choice(TABLE_THEMES)
    count = rng.choice((5, 7)) if template == "median" else rng.randint(4, 7)
    names = rng.sample(theme.names, count)
    values = _distinct_values(rng, count, *theme.value_range)
    synth = {
        "kind": "table",
        "title": theme.title,
        "header": [theme.entity_header, theme.measure_header],
        "names": names,
        "values": values,
        "template": template,
    }
    return synth, theme


def _table_integer(rng: random.Random) -> Problem | None:
    template = rng.choice(("total", "pair_sum", "range", "median", "count_above"))
    synth, theme = _table_data(rng, template)
    names, values = synth["names"], synth["values"]
    if template == "total":
        return Problem(
            synth,
            theme.total_question,
            str(sum(values)),
            "integer",
            ARITHMETIC_STATISTICS,
            unit=theme.unit,
        )
    if template == "pair_sum":
        first, second = rng.sample(range(len(names)), 2)
        synth["operands"] = [names[first], names[second]]
        question = f"What is the combined {theme.measure} of {names[first]} and {names[second]}?"
        return Problem(
            synth,
            question,
            str(values[first] + values[second]),
            "integer",
            ARITHMETIC_STATISTICS,
            unit=theme.unit,
        )
    if template == "range":
        question = f"What is the difference between the highest and the lowest {theme.measure}?"
        return Problem(
            synth,
            question,
            str(max(values) - min(values)),
            "integer",
            ARITHMETIC_STATISTICS,
            unit=theme.unit,
        )
    if template == "median":
        median = sorted(values)[len(values) // 2]
        return Problem(
            synth,
            f"What is the median {theme.measure}?",
            str(median),
            "integer",
            ARITHMETIC_STATISTICS,
            unit=theme.unit,
        )
    threshold = _threshold_between(rng, values)
    if threshold is None:
        return None
    synth["threshold"] = threshold
    question = f"How many {theme.plural} have {_article(theme.measure)} {theme.measure} greater than {threshold}?"
    return Problem(
        synth,
        question,
        str(sum(value > threshold for value in values)),
        "integer",
        ARITHMETIC_STATISTICS,
    )


def _table_float(rng: random.Random) -> Problem | None:
    synth, theme = _table_data(rng, "mean")
    question = f"What is the average {theme.measure} of the {theme.plural}?"
    return _float_problem(
        synth,
        question,
        _mean(synth["values"]),
        rng.choice((1, 2)),
        ARITHMETIC_STATISTICS,
        unit=theme.unit,
    )


def _table_choice(rng: random.Random) -> Problem | None:
    template = rng.choice(("argmax", "argmin"))
    synth, theme = _table_data(rng, template)
    names, values = synth["names"], synth["values"]
    pick = max if template == "argmax" else min
    answer = names[values.index(pick(values))]
    question = theme.most_question if template == "argmax" else theme.least_question
    return Problem(
        synth,
        question,
        answer,
        "text",
        ARITHMETIC_STATISTICS,
        choices=_text_choices(rng, answer, names),
    )


# -------------------------------------------------------------------- geometry


def _right_triangle(
    template: str, vertical: int | None, horizontal: int | None, hypotenuse: int | None
) -> dict[str, Any]:
    return {
        "kind": "geometry",
        "shape": "right_triangle",
        "template": template,
        "vertical": vertical,
        "horizontal": horizontal,
        "hypotenuse": hypotenuse,
    }


def _right_triangle_problem(rng: random.Random, precision: int | None) -> Problem | None:
    """Two sides are labelled, the third is "?": a Pythagorean triple when the answer is an integer."""
    template = rng.choice(("hypotenuse", "leg"))
    if precision is None:
        vertical, horizontal, hypotenuse = rng.choice(PYTHAGOREAN_TRIPLES)
        if rng.random() < 0.5:
            vertical, horizontal = horizontal, vertical
    elif template == "hypotenuse":
        vertical, horizontal = rng.sample(range(2, 21), 2)
        hypotenuse = math.hypot(vertical, horizontal)
    else:
        hypotenuse = rng.randint(5, 25)
        vertical = rng.randint(2, hypotenuse - 2)
        horizontal = math.sqrt(hypotenuse**2 - vertical**2)
    if template == "hypotenuse":
        synth = _right_triangle(template, vertical, horizontal, None)
        question, value = "What is the length of the hypotenuse of the right triangle?", hypotenuse
    else:
        synth = _right_triangle(template, vertical, None, hypotenuse)
        question, value = "What is the length of the unknown leg of the right triangle?", horizontal
    if precision is None:
        return Problem(synth, question, str(value), "integer", GEOMETRY_ALGEBRA)
    return _float_problem(synth, question, value, precision, GEOMETRY_ALGEBRA)


def _angle_choices(rng: random.Random, answer: int, known: Sequence[int]) -> list[str]:
    near = (
        {answer + delta for delta in (-20, -15, -10, -5, 5, 10, 15, 20)}
        | set(known)
        | {180 - answer}
    )
    candidates = sorted(angle for angle in near if 0 < angle < 180 and angle != answer)
    return [f"{angle}°" for angle in sorted(rng.sample(candidates, 3) + [answer])]


def _angle_problem(rng: random.Random, as_choice: bool) -> Problem:
    if rng.random() < 0.6:
        first = rng.randint(25, 100)
        second = rng.randint(25, 155 - first)
        synth = {
            "kind": "geometry",
            "shape": "triangle",
            "template": "third_angle",
            "angles": [first, second],
        }
        question, answer, known = (
            "What is the measure of angle C in triangle ABC?",
            180 - first - second,
            [first, second],
        )
    else:
        given = rng.choice([angle for angle in range(30, 151) if angle != 90])
        synth = {
            "kind": "geometry",
            "shape": "straight_angle",
            "template": "supplement",
            "angle": given,
        }
        question, answer, known = (
            "The two angles lie on a straight line. What is the value of x?",
            180 - given,
            [given],
        )
    if as_choice:
        return Problem(
            synth,
            question,
            f"{answer}°",
            "text",
            GEOMETRY_ALGEBRA,
            choices=_angle_choices(rng, answer, known),
        )
    return Problem(synth, f"{question} (in degrees)", str(answer), "integer", GEOMETRY_ALGEBRA)


def _rectangle_problem(
    rng: random.Random, width: float, height: float, precision: int | None
) -> Problem | None:
    template = rng.choice(("area", "perimeter"))
    synth = {
        "kind": "geometry",
        "shape": "rectangle",
        "template": template,
        "width": width,
        "height": height,
    }
    exact_width, exact_height = Fraction(str(width)), Fraction(str(height))
    value = exact_width * exact_height if template == "area" else 2 * (exact_width + exact_height)
    question = f"What is the {template} of the rectangle?"
    if precision is None:
        return Problem(synth, question, str(int(value)), "integer", GEOMETRY_ARITHMETIC)
    return _float_problem(synth, question, value, precision, GEOMETRY_ARITHMETIC)


def _circle_problem(rng: random.Random) -> Problem | None:
    template = rng.choice(("area", "circumference"))
    radius, precision = rng.randint(2, 20), rng.choice((1, 2))
    synth = {"kind": "geometry", "shape": "circle", "template": template, "radius": radius}

    def measure(pi: float) -> float:
        return pi * radius * radius if template == "area" else 2 * pi * radius

    if format_float(measure(math.pi), precision) != format_float(measure(PI_AS_STATED), precision):
        return None
    question = f"What is the {template} of the circle? Use π ≈ {PI_AS_STATED}."
    return _float_problem(synth, question, measure(PI_AS_STATED), precision, GEOMETRY_ARITHMETIC)


def _geometry_integer(rng: random.Random) -> Problem | None:
    shape = rng.choice(("right_triangle", "rectangle", "angle"))
    if shape == "right_triangle":
        return _right_triangle_problem(rng, None)
    if shape == "rectangle":
        return _rectangle_problem(rng, rng.randint(3, 30), rng.randint(2, 25), None)
    return _angle_problem(rng, as_choice=False)


def _geometry_float(rng: random.Random) -> Problem | None:
    shape = rng.choice(("right_triangle", "rectangle", "circle"))
    precision = rng.choice((1, 2))
    if shape == "right_triangle":
        return _right_triangle_problem(rng, precision)
    if shape == "rectangle":
        width, height = (rng.choice([t for t in range(11, 160) if t % 10]) / 10 for _ in range(2))
        return _rectangle_problem(rng, width, height, precision)
    return _circle_problem(rng)


def _geometry_choice(rng: random.Random) -> Problem | None:
    return _angle_problem(rng, as_choice=True)


BUILDERS: dict[str, dict[str, Callable[[random.Random], Problem | None]]] = {
    "bar": {"integer": _bar_integer, "float": _bar_float, "multi_choice": _bar_choice},
    "line": {"integer": _line_integer, "float": _line_float, "multi_choice": _line_choice},
    "table": {"integer": _table_integer, "float": _table_float, "multi_choice": _table_choice},
    "geometry": {
        "integer": _geometry_integer,
        "float": _geometry_float,
        "multi_choice": _geometry_choice,
    },
}


# ------------------------------------------------------------------- rendering


@lru_cache(maxsize=64)
def _font(pixels: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=max(6, pixels))


def _number_text(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.1f}"


def _line_width(size: int) -> int:
    return max(1, round(size / 170))


def _draw_title(draw: ImageDraw.ImageDraw, title: str, size: int) -> None:
    draw.text(
        (size / 2, size * 0.06), title, fill=INK, font=_font(round(size * 0.042)), anchor="mm"
    )


def _axis_scale(max_value: int) -> tuple[int, int]:
    """(axis top, tick step) with headroom above the largest value for its label."""
    step = next(step for step in (5, 10, 20, 25) if max_value / step <= 6)
    return step * (max_value // step + 1), step


def _draw_value_axis(
    draw: ImageDraw.ImageDraw, box: tuple[float, float, float, float], max_value: int, size: int
) -> Callable[[float], float]:
    """Grid lines and tick labels; returns the value -> y pixel mapping."""
    left, top, right, bottom = box
    axis_top, step = _axis_scale(max_value)

    def y_of(value: float) -> float:
        return bottom - value / axis_top * (bottom - top)

    font = _font(round(size * 0.03))
    for tick in range(0, axis_top + 1, step):
        draw.line([(left, y_of(tick)), (right, y_of(tick))], fill=GRID, width=1)
        draw.text((left - size * 0.015, y_of(tick)), str(tick), fill=INK, font=font, anchor="rm")
    width = _line_width(size)
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=INK, width=width)
    return y_of


def _plot_box(size: int) -> tuple[float, float, float, float]:
    return size * 0.12, size * 0.13, size * 0.96, size * 0.84


def _draw_bar(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    _draw_title(draw, synth["title"], size)
    left, _, right, bottom = box = _plot_box(size)
    y_of = _draw_value_axis(draw, box, max(synth["values"]), size)
    slot = (right - left) / len(synth["values"])
    font = _font(round(size * 0.032))
    for i, (label, value) in enumerate(zip(synth["labels"], synth["values"])):
        center = left + slot * (i + 0.5)
        draw.rectangle(
            [center - slot * 0.3, y_of(value), center + slot * 0.3, bottom - 1],
            fill=PALETTE[synth["color"]],
        )
        draw.text(
            (center, y_of(value) - size * 0.008), str(value), fill=INK, font=font, anchor="md"
        )
        draw.text((center, bottom + size * 0.02), label, fill=INK, font=font, anchor="ma")


def _draw_line(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    _draw_title(draw, synth["title"], size)
    left, _, right, bottom = box = _plot_box(size)
    y_of = _draw_value_axis(draw, box, max(synth["y"]), size)
    slot = (right - left) / len(synth["x"])
    ys = synth["y"]
    points = [(left + slot * (i + 0.5), y_of(y)) for i, y in enumerate(ys)]
    color, font, radius = PALETTE[synth["color"]], _font(round(size * 0.03)), size * 0.009
    draw.line(points, fill=color, width=_line_width(size) + 1)
    for px, py in points:
        draw.ellipse([px - radius, py - radius, px + radius, py + radius], fill=color)
    offset = size * 0.018
    for i, ((px, py), x, y) in enumerate(zip(points, synth["x"], ys)):
        is_valley = all(ys[j] > y for j in (i - 1, i + 1) if 0 <= j < len(ys))
        if is_valley and py + offset + size * 0.04 < bottom:
            _backed_text(draw, (px, py + offset), str(y), font, "ma")
        else:
            _backed_text(draw, (px, py - offset), str(y), font, "md")
        draw.text((px, bottom + size * 0.02), str(x), fill=INK, font=font, anchor="ma")
    axis_name = "Year" if synth["x_name"] == "year" else "x"
    draw.text(((left + right) / 2, size * 0.95), axis_name, fill=INK, font=font, anchor="mm")


def _backed_text(
    draw: ImageDraw.ImageDraw,
    xy: tuple[float, float],
    text: str,
    font: ImageFont.FreeTypeFont | ImageFont.ImageFont,
    anchor: str,
) -> None:
    """Text on a white patch, so that a line running under a value label cannot hide a digit."""
    x0, y0, x1, y1 = draw.textbbox(xy, text, font=font, anchor=anchor)
    pad = max(1, (y1 - y0) // 5)
    draw.rectangle([x0 - pad, y0 - pad, x1 + pad, y1 + pad], fill=BACKGROUND)
    draw.text(xy, text, fill=INK, font=font, anchor=anchor)


def _draw_table(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    _draw_title(draw, synth["title"], size)
    rows = [synth["header"]] + [
        [name, str(value)] for name, value in zip(synth["names"], synth["values"])
    ]
    left, right, top = size * 0.15, size * 0.85, size * 0.14
    row_height = min(size * 0.1, size * 0.8 / len(rows))
    middle = left + (right - left) * 0.5
    font, width = _font(round(min(size * 0.036, row_height * 0.5))), _line_width(size)
    draw.rectangle([left, top, right, top + row_height], fill=HEADER_FILL)
    for r, (name, value) in enumerate(rows):
        center_y = top + row_height * (r + 0.5)
        draw.text(((left + middle) / 2, center_y), name, fill=INK, font=font, anchor="mm")
        draw.text(((middle + right) / 2, center_y), value, fill=INK, font=font, anchor="mm")
    bottom = top + row_height * len(rows)
    for r in range(len(rows) + 1):
        draw.line(
            [(left, top + row_height * r), (right, top + row_height * r)], fill=INK, width=width
        )
    for x in (left, middle, right):
        draw.line([(x, top), (x, bottom)], fill=INK, width=width)


def _fit(
    points: Sequence[tuple[float, float]], size: int, margin: float = 0.2
) -> list[tuple[float, float]]:
    """Scale and centre shape coordinates (y up) into the image (y down)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    span = max(max(xs) - min(xs), max(ys) - min(ys))
    scale = size * (1 - 2 * margin) / span
    offset_x = (size - (max(xs) - min(xs)) * scale) / 2
    offset_y = (size - (max(ys) - min(ys)) * scale) / 2
    return [
        (offset_x + (x - min(xs)) * scale, size - offset_y - (y - min(ys)) * scale)
        for x, y in points
    ]


def _label_or_unknown(value: float | None) -> str:
    return "?" if value is None else _number_text(value)


def _draw_right_triangle(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    vertical = synth["vertical"] or math.sqrt(synth["hypotenuse"] ** 2 - synth["horizontal"] ** 2)
    horizontal = synth["horizontal"] or math.sqrt(synth["hypotenuse"] ** 2 - synth["vertical"] ** 2)
    # Extreme leg ratios are drawn less extreme so that the short leg keeps room for its label.
    shown_vertical = min(max(vertical / horizontal, 0.35), 2.5)
    corner, end, top = _fit([(0, 0), (1, 0), (0, shown_vertical)], size)
    width, font, gap = _line_width(size) + 1, _font(round(size * 0.042)), size * 0.03
    draw.polygon([corner, end, top], outline=INK, width=width)
    mark = size * 0.035
    draw.line(
        [
            (corner[0] + mark, corner[1]),
            (corner[0] + mark, corner[1] - mark),
            (corner[0], corner[1] - mark),
        ],
        fill=INK,
        width=max(1, width - 1),
    )
    draw.text(
        ((corner[0] + end[0]) / 2, corner[1] + gap),
        _label_or_unknown(synth["horizontal"]),
        fill=INK,
        font=font,
        anchor="ma",
    )
    draw.text(
        (corner[0] - gap, (corner[1] + top[1]) / 2),
        _label_or_unknown(synth["vertical"]),
        fill=INK,
        font=font,
        anchor="rm",
    )
    draw.text(
        ((end[0] + top[0]) / 2 + gap, (end[1] + top[1]) / 2 - gap),
        _label_or_unknown(synth["hypotenuse"]),
        fill=INK,
        font=font,
        anchor="ld",
    )


def _draw_rectangle(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    width, height = synth["width"], synth["height"]
    shown_height = min(max(height / width, 0.4), 1.6)
    (x0, y0), (x1, y1) = _fit([(0, 0), (1, shown_height)], size)
    font, gap = _font(round(size * 0.042)), size * 0.03
    draw.rectangle([x0, y1, x1, y0], outline=INK, width=_line_width(size) + 1)
    draw.text(((x0 + x1) / 2, y0 + gap), _number_text(width), fill=INK, font=font, anchor="ma")
    draw.text((x1 + gap, (y0 + y1) / 2), _number_text(height), fill=INK, font=font, anchor="lm")


def _polar(origin: tuple[float, float], degrees: float, distance: float) -> tuple[float, float]:
    """The point `distance` from `origin` at `degrees` counter-clockwise on screen."""
    return origin[0] + distance * math.cos(math.radians(degrees)), origin[1] - distance * math.sin(
        math.radians(degrees)
    )


def _draw_angle(
    draw: ImageDraw.ImageDraw,
    vertex: tuple[float, float],
    start: float,
    end: float,
    radius: float,
    label: str,
    size: int,
) -> None:
    """Arc from `start` to `end` degrees counter-clockwise, labelled on its bisector."""
    box = [vertex[0] - radius, vertex[1] - radius, vertex[0] + radius, vertex[1] + radius]
    draw.arc(box, -end, -start, fill=INK, width=_line_width(size))
    # A narrow angle pushes its label further out so that the text clears both sides.
    clearance = size * 0.045 / math.sin(math.radians((end - start) / 2))
    distance = min(max(radius * 1.75, clearance), size * 0.2)
    draw.text(
        _polar(vertex, (start + end) / 2, distance),
        label,
        fill=INK,
        font=_font(round(size * 0.038)),
        anchor="mm",
    )


def _draw_triangle(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    first, second = synth["angles"]
    apex_distance = math.sin(math.radians(second)) / math.sin(math.radians(180 - first - second))
    apex = (
        apex_distance * math.cos(math.radians(first)),
        apex_distance * math.sin(math.radians(first)),
    )
    a, b, c = _fit([(0, 0), (1, 0), apex], size, margin=0.18)
    draw.polygon([a, b, c], outline=INK, width=_line_width(size) + 1)
    radius = size * 0.06
    _draw_angle(draw, a, 0, first, radius, f"{first}°", size)
    _draw_angle(draw, b, 180 - second, 180, radius, f"{second}°", size)
    _draw_angle(draw, c, 180 + first, 360 - second, radius * 0.8, "?", size)
    font, gap = _font(round(size * 0.045)), size * 0.04
    centroid = ((a[0] + b[0] + c[0]) / 3, (a[1] + b[1] + c[1]) / 3)
    for name, (x, y) in zip("ABC", (a, b, c)):
        away = math.hypot(x - centroid[0], y - centroid[1])
        draw.text(
            (x + (x - centroid[0]) / away * gap, y + (y - centroid[1]) / away * gap),
            name,
            fill=INK,
            font=font,
            anchor="mm",
        )


def _draw_straight_angle(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    given = synth["angle"]
    vertex = (size * 0.5, size * 0.62)
    width = _line_width(size) + 1
    draw.line([(size * 0.1, vertex[1]), (size * 0.9, vertex[1])], fill=INK, width=width)
    draw.line([vertex, _polar(vertex, given, size * 0.38)], fill=INK, width=width)
    radius = size * 0.07
    _draw_angle(draw, vertex, 0, given, radius, f"{given}°", size)
    _draw_angle(draw, vertex, given, 180, radius * 1.3, "x", size)


def _draw_circle(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    center, radius = (size / 2, size / 2), size * 0.33
    width, dot = _line_width(size) + 1, size * 0.012
    draw.ellipse(
        [center[0] - radius, center[1] - radius, center[0] + radius, center[1] + radius],
        outline=INK,
        width=width,
    )
    draw.ellipse([center[0] - dot, center[1] - dot, center[0] + dot, center[1] + dot], fill=INK)
    draw.line([center, (center[0] + radius, center[1])], fill=INK, width=width)
    draw.text(
        (center[0] + radius / 2, center[1] - size * 0.02),
        f"r = {synth['radius']}",
        fill=INK,
        font=_font(round(size * 0.045)),
        anchor="md",
    )


GEOMETRY_RENDERERS = {
    "right_triangle": _draw_right_triangle,
    "rectangle": _draw_rectangle,
    "triangle": _draw_triangle,
    "straight_angle": _draw_straight_angle,
    "circle": _draw_circle,
}


def _draw_geometry(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    GEOMETRY_RENDERERS[synth["shape"]](draw, synth, size)


RENDERERS: dict[str, Callable[[ImageDraw.ImageDraw, dict[str, Any], int], None]] = {
    "bar": _draw_bar,
    "line": _draw_line,
    "table": _draw_table,
    "geometry": _draw_geometry,
}
