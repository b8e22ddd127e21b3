"""Tables: a themed two-column table (names and one measure), and word problems about it.

Why this exists: MathVista's math-word-problem items read numbers off a table and total,
compare or average them; this module owns the table kind's data, its questions and its drawing,
so that every answer comes from the very cells the table shows.

Deliberate choices:
- A median question gets an odd number of rows (5 or 7), so the median is one of the cells.
- Each theme words its own total and extreme questions ("Who is the oldest?"), so the text reads
  naturally instead of naming the measure generically.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from PIL import ImageDraw

from vlmrl.data.synth.canvas import HEADER_FILL, INK, default_font, draw_title, line_width
from vlmrl.data.synth.core import (
    ARITHMETIC_STATISTICS,
    Kind,
    Problem,
    article,
    distinct_values,
    extreme_index,
    float_problem,
    integer_problem,
    mean,
    text_choices,
    threshold_between,
)


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


def _table_data(rng: random.Random, template: str) -> tuple[dict[str, Any], TableTheme]:
    theme = rng.choice(TABLE_THEMES)
    count = rng.choice((5, 7)) if template == "median" else rng.randint(4, 7)
    names = rng.sample(theme.names, count)
    values = distinct_values(rng, count, *theme.value_range)
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
    if template == "count_above":
        threshold = threshold_between(rng, values)
        if threshold is None:
            return None
        synth["threshold"] = threshold
        question = f"How many {theme.plural} have {article(theme.measure)} {theme.measure} greater than {threshold}?"
        answer = sum(value > threshold for value in values)
        return integer_problem(synth, question, answer, ARITHMETIC_STATISTICS)
    if template == "total":
        question, answer = theme.total_question, sum(values)
    elif template == "pair_sum":
        first, second = rng.sample(range(len(names)), 2)
        synth["operands"] = [names[first], names[second]]
        question = f"What is the combined {theme.measure} of {names[first]} and {names[second]}?"
        answer = values[first] + values[second]
    elif template == "range":
        question = f"What is the difference between the highest and the lowest {theme.measure}?"
        answer = max(values) - min(values)
    else:  # median
        question, answer = f"What is the median {theme.measure}?", sorted(values)[len(values) // 2]
    return integer_problem(synth, question, answer, ARITHMETIC_STATISTICS, unit=theme.unit)


def _table_float(rng: random.Random) -> Problem | None:
    synth, theme = _table_data(rng, "mean")
    question = f"What is the average {theme.measure} of the {theme.plural}?"
    return float_problem(
        synth,
        question,
        mean(synth["values"]),
        rng.choice((1, 2)),
        ARITHMETIC_STATISTICS,
        unit=theme.unit,
    )


def _table_choice(rng: random.Random) -> Problem | None:
    template = rng.choice(("argmax", "argmin"))
    synth, theme = _table_data(rng, template)
    names = synth["names"]
    answer = names[extreme_index(template, synth["values"])]
    question = theme.most_question if template == "argmax" else theme.least_question
    return Problem(
        synth,
        question,
        answer,
        "text",
        ARITHMETIC_STATISTICS,
        choices=text_choices(rng, answer, names),
    )


def _draw_table(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    draw_title(draw, synth["title"], size)
    rows = [synth["header"]] + [
        [name, str(value)] for name, value in zip(synth["names"], synth["values"])
    ]
    left, right, top = size * 0.15, size * 0.85, size * 0.14
    row_height = min(size * 0.1, size * 0.8 / len(rows))
    middle = left + (right - left) * 0.5
    font, width = default_font(round(min(size * 0.036, row_height * 0.5))), line_width(size)
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


KIND = Kind(
    name="table",
    context=("table", "math word problem", "elementary school"),
    builders={"integer": _table_integer, "float": _table_float, "multi_choice": _table_choice},
    draw=_draw_table,
    tier="chart",
)
