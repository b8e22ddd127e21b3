"""The synthetic set's easiest tier, "read": a card with one digit drawn on it, and a question
that states the digit again.

Why this exists: a tiny random model cannot learn to read pixels in a few CPU steps (the LoRA
never touches the vision tower), but it can learn to copy one token of its prompt into the
answer, so this tier is where the default pipeline can show accuracy move at all.
The harder tiers are "chart" (bar, line, table) and "geometry".

Deliberate choices:
- Digits 1-9 only: each is one token in Qwen's tokenizer, a 9-way answer space.
- Read items are not part of the kind rotation of `vlmrl.data.synth.generate`: they come from
  `generate_read`, with their own pid prefix (`synth-read-NNNNN`) and generator key, so adding
  them never renumbers or redraws a regular item.
"""

from __future__ import annotations

import random
from typing import Any

from PIL import ImageDraw

from vlmrl.data.synth.canvas import INK, default_font
from vlmrl.data.synth.core import Kind, Problem

DIGITS = tuple(range(1, 10))
CARD_FILLS = ((214, 228, 247), (252, 232, 178), (206, 234, 214), (250, 210, 207))
TEMPLATES = (
    ("card", "The card in the image shows the number {n}. What number is on the card?"),
    ("sign", "A sign in the picture reads {n}. What number does the sign show?"),
    ("box", "The box is labelled {n}. What is the label of the box?"),
    ("tile", "This tile has the number {n} on it. Which number is on the tile?"),
)
SKILLS = ("numeric commonsense",)


def _read_integer(rng: random.Random) -> Problem:
    value = rng.choice(DIGITS)
    template, question = rng.choice(TEMPLATES)
    synth = {"kind": "read", "template": template, "value": value,
             "fill": rng.randrange(len(CARD_FILLS))}
    return Problem(synth, question.format(n=value), str(value), "integer", SKILLS)


def _draw_card(draw: ImageDraw.ImageDraw, synth: dict[str, Any], size: int) -> None:
    margin = size * 0.2
    draw.rounded_rectangle((margin, margin, size - margin, size - margin), radius=size * 0.05,
                           fill=CARD_FILLS[synth["fill"]], outline=INK, width=max(1, size // 100))
    draw.text((size / 2, size / 2), str(synth["value"]), fill=INK,
              font=default_font(round(size * 0.4)), anchor="mm")


KIND = Kind(
    name="read",
    context=("text card", "figure question answering", "elementary school"),
    builders={"integer": _read_integer},
    draw=_draw_card,
    tier="read",
    pid_prefix="synth-read",
)
