"""Bar charts: themed labels with distinct integer values, and questions about them.

Why this exists: reading values off bars, comparing and summing them is a staple of MathVista's
figure questions; this module owns the bar kind's data, its questions and its drawing, so that every
answer comes from the very values the bars show.

Deliberate choices:
- Values are distinct, so "the tallest bar" and "the category with the largest value" have one
  answer.
- Months and answer letters keep their natural order; other labels are shuffled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from PIL import ImageDraw

from vlmrl.data.synth.canvas import (
    INK,
    PALETTE,
    default_font,
    draw_title,
    draw_value_axis,
    plot_box,
)
from vlmrl.data.synth.core import (
    ARITHMETIC_STATISTICS,
    STATISTICS,
    Kind,
    Problem,
    distinct_values,
    extreme_index,
    float_problem,
    integer_problem,
    mean,
    text_choices,
    threshold_between,
)


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


def _bar_data(rng: random.Random, template: str) -> dict[str, Any]:
    theme = rng.choice(BAR_THEMES)
    count = rng.randint(4, min(7, len(theme.labels)))
    labels = rng.sample(theme.labels, count)
    if theme.keep_order:
        labels.sort(key=theme.labels.index)
    values = distinct_values(rng, count, 3, 95)
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
    if template in ("max", "min"):
        extreme = "tallest" if template == "max" else "shortest"
        value = max(values) if template == "max" else min(values)
        return integer_problem(synth, f"What is the value of the {extreme} bar?", value, STATISTICS)
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
        return integer_problem(synth, question, answer, ARITHMETIC_STATISTICS)
    if template == "total":
        question = "What is the sum of all the values in the chart?"
        return integer_problem(synth, question, sum(values), ARITHMETIC_STATISTICS)
    threshold = threshold_between(rng, values)
    if threshold is None:
        return None
    synth["threshold"] = threshold
    question = f"How many bars have a value greater than {threshold}?"
    return integer_problem(synth, question, sum(value > threshold for value in values), STATISTICS)


def _bar_float(rng: random.Random) -> Problem | None:
    template = rng.choice(("mean", "ratio"))
    synth = _bar_data(rng, template)
    labels, values = synth["labels"], synth["values"]
    if template == "mean":
        precision = rng.choice((1, 2))
        return float_problem(
            synth,
            "What is the average of all the values in the chart?",
            mean(values),
            precision,
            ARITHMETIC_STATISTICS,
        )
    first, second = rng.sample(range(len(labels)), 2)
    synth["operands"] = [labels[first], labels[second]]
    question = (
        f"What is the ratio of the value of {labels[first]} to the value of {labels[second]}?"
    )
    return float_problem(
        synth, question, Fraction(values[first], values[second]), 2, ARITHMETIC_STATISTICS
    )


def _bar_choice(rng: random.Random) -> Problem | None:
    template = rng.choice(("argmax", "argmin"))
    synth = _bar_data(rng, template)
    labels = synth["labels"]
    answer = labels[extreme_index(template, synth["values"])]
    adjective = "largest" if template == "argmax" else "smallest"
    return Problem(
        synth,
        f"Which category has the {adjective} value?",
        answer,
        "text",
        STATISTICS,
        choices=text_choices(rng, answer, labels),
    )


def _draw_bar(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    draw_title(draw, synth["title"], size)
    left, _, right, bottom = box = plot_box(size)
    y_of = draw_value_axis(draw, box, max(synth["values"]), size)
    slot = (right - left) / len(synth["values"])
    font = default_font(round(size * 0.032))
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


KIND = Kind(
    name="bar",
    context=("bar chart", "figure question answering", "not applicable"),
    builders={"integer": _bar_integer, "float": _bar_float, "multi_choice": _bar_choice},
    draw=_draw_bar,
    tier="chart",
)
