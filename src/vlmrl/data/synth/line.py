"""Line plots: a measure over consecutive years (or x values), and questions about its course.

Why this exists: MathVista asks for values at a point, increases, averages over a span and
extremes of plotted series; this module owns the line kind's data, its questions and its
drawing, so that every answer comes from the very points the plot shows.

Deliberate choices:
- Every point carries its value label on a white patch, below the point at a valley and above it
  elsewhere, so that neither the line nor a neighbouring label hides a digit.
- Questions about an increase use a rising pair only, so the answer is never negative.
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
    backed_text,
    default_font,
    draw_title,
    draw_value_axis,
    line_width,
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
)


@dataclass(frozen=True)
class LineTheme:
    title: str
    measure: str
    unit: str | None
    x_name: str = "year"  # "year" or "x"


LINE_THEMES = (
    LineTheme("Books sold by a shop", "number of books sold", None),
    LineTheme("Rainfall in June", "rainfall", "mm"),
    LineTheme("Members of a chess club", "number of members", None),
    LineTheme("Price of a concert ticket", "ticket price", "dollars"),
    LineTheme("Measured values of y", "y value", None, x_name="x"),
)


def _line_data(rng: random.Random, template: str) -> dict[str, Any]:
    theme = rng.choice(LINE_THEMES)
    count = rng.randint(5, 8)
    start = rng.randint(2008, 2018) if theme.x_name == "year" else rng.randint(0, 2)
    values = distinct_values(rng, count, 5, 95)
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


def _rising_pair(
    rng: random.Random, synth: dict[str, Any], min_gap: int
) -> tuple[int, int] | None:
    """Indices i < j at least `min_gap` apart whose value rises from i to j (their x values
    become the question's operands); None where the series has no such pair."""
    ys = synth["y"]
    pairs = [(i, j) for i in range(len(ys)) for j in range(i + min_gap, len(ys)) if ys[j] > ys[i]]
    if not pairs:
        return None
    i, j = rng.choice(pairs)
    synth["operands"] = [synth["x"][i], synth["x"][j]]
    return i, j


def _line_integer(rng: random.Random) -> Problem | None:
    template = rng.choice(("value_at", "increase", "range"))
    synth = _line_data(rng, template)
    xs, ys, measure = synth["x"], synth["y"], synth["measure"]
    if template == "value_at":
        index = rng.randrange(len(xs))
        synth["operands"] = [xs[index]]
        question = f"What is the {measure} {_at(synth, xs[index])}?"
        return integer_problem(synth, question, ys[index], STATISTICS, unit=synth["unit"])
    if template == "range":
        question = f"What is the difference between the highest and the lowest {measure}?"
        skills = ARITHMETIC_STATISTICS
        return integer_problem(synth, question, max(ys) - min(ys), skills, unit=synth["unit"])
    pair = _rising_pair(rng, synth, 1)
    if pair is None:
        return None
    i, j = pair
    question = f"By how much did the {measure} increase {_from_to(synth, xs[i], xs[j])}?"
    skills = ARITHMETIC_STATISTICS
    return integer_problem(synth, question, ys[j] - ys[i], skills, unit=synth["unit"])


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
        return float_problem(
            synth,
            question,
            mean(ys[i : j + 1]),
            precision,
            ARITHMETIC_STATISTICS,
            unit=synth["unit"],
        )
    pair = _rising_pair(rng, synth, 2)
    if pair is None:
        return None
    i, j = pair
    step = "year" if synth["x_name"] == "year" else "unit of x"
    question = (
        f"What is the average increase per {step} in the {measure} {_from_to(synth, xs[i], xs[j])}?"
    )
    return float_problem(
        synth, question, Fraction(ys[j] - ys[i], j - i), precision, ARITHMETIC_STATISTICS
    )


def _line_choice(rng: random.Random) -> Problem | None:
    template = rng.choice(("argmax", "argmin"))
    synth = _line_data(rng, template)
    xs = synth["x"]
    answer = xs[extreme_index(template, synth["y"])]
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


def _draw_line(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    draw_title(draw, synth["title"], size)
    left, _, right, bottom = box = plot_box(size)
    y_of = draw_value_axis(draw, box, max(synth["y"]), size)
    slot = (right - left) / len(synth["x"])
    ys = synth["y"]
    points = [(left + slot * (i + 0.5), y_of(y)) for i, y in enumerate(ys)]
    color, font, radius = PALETTE[synth["color"]], default_font(round(size * 0.03)), size * 0.009
    draw.line(points, fill=color, width=line_width(size) + 1)
    for px, py in points:
        draw.ellipse([px - radius, py - radius, px + radius, py + radius], fill=color)
    offset = size * 0.018
    for i, ((px, py), x, y) in enumerate(zip(points, synth["x"], ys)):
        is_valley = all(ys[j] > y for j in (i - 1, i + 1) if 0 <= j < len(ys))
        if is_valley and py + offset + size * 0.04 < bottom:
            backed_text(draw, (px, py + offset), str(y), font, "ma")
        else:
            backed_text(draw, (px, py - offset), str(y), font, "md")
        draw.text((px, bottom + size * 0.02), str(x), fill=INK, font=font, anchor="ma")
    axis_name = "Year" if synth["x_name"] == "year" else "x"
    draw.text(((left + right) / 2, size * 0.95), axis_name, fill=INK, font=font, anchor="mm")


KIND = Kind(
    name="line",
    context=("line plot", "figure question answering", "not applicable"),
    builders={"integer": _line_integer, "float": _line_float, "multi_choice": _line_choice},
    draw=_draw_line,
    tier="chart",
)
