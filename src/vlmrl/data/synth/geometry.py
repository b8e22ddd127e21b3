"""Geometry diagrams: right triangles, rectangles, triangle and straight-line angles, circles,
with one unknown to compute.

Why this exists: MathVista's geometry problems ask for a length, an area or an angle from a
labelled figure; this module owns the geometry kind's shapes, its questions and its drawing, so
that every answer follows from the very labels the figure shows.

Deliberate choices:
- An integer right-triangle answer comes from a Pythagorean triple; a float one from any legs.
- Circle questions state π ≈ 3.14159 and are kept only where that value and the true π round to
  the same answer, so a model using either is right.
- Rectangle sides are exact decimals (`Fraction(str(side))`), so area and perimeter are exact.
- Figures are drawn in proportion only within limits (a very flat triangle is drawn less flat),
  so every side keeps room for its label; the labels, not the proportions, carry the numbers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from PIL import ImageDraw

from vlmrl.data.synth.canvas import INK, default_font, fit, line_width, number_text
from vlmrl.data.synth.core import (
    GEOMETRY_ALGEBRA,
    GEOMETRY_ARITHMETIC,
    Kind,
    Problem,
    float_problem,
    format_float,
)

PI_AS_STATED = 3.14159
PYTHAGOREAN_TRIPLES = tuple(
    (a, b, math.isqrt(a * a + b * b))
    for a in range(3, 41)
    for b in range(a + 1, 41)
    if math.isqrt(a * a + b * b) ** 2 == a * a + b * b
)


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
    return float_problem(synth, question, value, precision, GEOMETRY_ALGEBRA)


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
    return float_problem(synth, question, value, precision, GEOMETRY_ARITHMETIC)


def _circle_problem(rng: random.Random) -> Problem | None:
    template = rng.choice(("area", "circumference"))
    radius, precision = rng.randint(2, 20), rng.choice((1, 2))
    synth = {"kind": "geometry", "shape": "circle", "template": template, "radius": radius}

    def measure(pi: float) -> float:
        return pi * radius * radius if template == "area" else 2 * pi * radius

    if format_float(measure(math.pi), precision) != format_float(measure(PI_AS_STATED), precision):
        return None
    question = f"What is the {template} of the circle? Use π ≈ {PI_AS_STATED}."
    return float_problem(synth, question, measure(PI_AS_STATED), precision, GEOMETRY_ARITHMETIC)


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


def _label_or_unknown(value: float | None) -> str:
    return "?" if value is None else number_text(value)


def _draw_right_triangle(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    vertical = synth["vertical"] or math.sqrt(synth["hypotenuse"] ** 2 - synth["horizontal"] ** 2)
    horizontal = synth["horizontal"] or math.sqrt(synth["hypotenuse"] ** 2 - synth["vertical"] ** 2)
    # Extreme leg ratios are drawn less extreme so that the short leg keeps room for its label.
    shown_vertical = min(max(vertical / horizontal, 0.35), 2.5)
    corner, end, top = fit([(0, 0), (1, 0), (0, shown_vertical)], size)
    width, font, gap = line_width(size) + 1, default_font(round(size * 0.042)), size * 0.03
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
    (x0, y0), (x1, y1) = fit([(0, 0), (1, shown_height)], size)
    font, gap = default_font(round(size * 0.042)), size * 0.03
    draw.rectangle([x0, y1, x1, y0], outline=INK, width=line_width(size) + 1)
    draw.text(((x0 + x1) / 2, y0 + gap), number_text(width), fill=INK, font=font, anchor="ma")
    draw.text((x1 + gap, (y0 + y1) / 2), number_text(height), fill=INK, font=font, anchor="lm")


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
    draw.arc(box, -end, -start, fill=INK, width=line_width(size))
    # A narrow angle pushes its label further out so that the text clears both sides.
    clearance = size * 0.045 / math.sin(math.radians((end - start) / 2))
    distance = min(max(radius * 1.75, clearance), size * 0.2)
    draw.text(
        _polar(vertex, (start + end) / 2, distance),
        label,
        fill=INK,
        font=default_font(round(size * 0.038)),
        anchor="mm",
    )


def _draw_triangle(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    first, second = synth["angles"]
    apex_distance = math.sin(math.radians(second)) / math.sin(math.radians(180 - first - second))
    apex = (
        apex_distance * math.cos(math.radians(first)),
        apex_distance * math.sin(math.radians(first)),
    )
    a, b, c = fit([(0, 0), (1, 0), apex], size, margin=0.18)
    draw.polygon([a, b, c], outline=INK, width=line_width(size) + 1)
    radius = size * 0.06
    _draw_angle(draw, a, 0, first, radius, f"{first}°", size)
    _draw_angle(draw, b, 180 - second, 180, radius, f"{second}°", size)
    _draw_angle(draw, c, 180 + first, 360 - second, radius * 0.8, "?", size)
    font, gap = default_font(round(size * 0.045)), size * 0.04
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
    width = line_width(size) + 1
    draw.line([(size * 0.1, vertex[1]), (size * 0.9, vertex[1])], fill=INK, width=width)
    draw.line([vertex, _polar(vertex, given, size * 0.38)], fill=INK, width=width)
    radius = size * 0.07
    _draw_angle(draw, vertex, 0, given, radius, f"{given}°", size)
    _draw_angle(draw, vertex, given, 180, radius * 1.3, "x", size)


def _draw_circle(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    center, radius = (size / 2, size / 2), size * 0.33
    width, dot = line_width(size) + 1, size * 0.012
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
        font=default_font(round(size * 0.045)),
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


KIND = Kind(
    name="geometry",
    context=("geometry diagram", "geometry problem solving", "high school"),
    builders={
        "integer": _geometry_integer,
        "float": _geometry_float,
        "multi_choice": _geometry_choice,
    },
    draw=_draw_geometry,
    tier="geometry",
)
