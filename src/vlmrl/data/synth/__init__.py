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

Layout: `core` (the `Problem`, the `Kind`, answer helpers, record assembly) and
`canvas` (colours, font, axes) are the floor; `bar`, `line`, `table` and
`geometry` each hold one kind's data, questions and drawing and import only the
floor. This module holds the one table of kinds and the public API.

Every record's `metadata["synth"]["tier"]` names its difficulty tier ("chart" for bar, line
and table, "geometry"); the easiest tier, "read" (`read`), is drawn by `generate_read`
apart from the kind rotation, so that adding read items changes no regular item.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from vlmrl.data.synth import bar, geometry, line, read, table
from vlmrl.data.synth.canvas import BACKGROUND
from vlmrl.data.synth.core import (
    ANSWER_FORMAT_WEIGHTS,
    ANSWER_FORMATS,
    Kind,
    assemble_record,
    build,
    format_float,
)

__all__ = ["KINDS", "TIERS", "format_float", "generate", "generate_read", "render", "save"]

_KIND_TABLE: dict[str, Kind] = {
    kind.name: kind for kind in (bar.KIND, line.KIND, table.KIND, geometry.KIND, read.KIND)
}
KINDS = ("bar", "line", "table", "geometry")  # record i is of kind KINDS[i % len(KINDS)]
TIERS = {name: kind.tier for name, kind in _KIND_TABLE.items()}


def generate(n: int, seed: int = 0, image_size: int = 512) -> list[dict[str, Any]]:
    """`n` MathVista-schema records with rendered RGB images of `image_size` pixels square."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    _check_image_size(image_size)
    return [_record(seed, index, image_size) for index in range(n)]


def generate_read(n: int, seed: int = 0, image_size: int = 512) -> list[dict[str, Any]]:
    """`n` records of the easiest tier, "read" (pids `synth-read-NNNNN`); `n` may be 0."""
    if n < 0:
        raise ValueError(f"n must be at least 0, got {n}")
    _check_image_size(image_size)
    return [_read_record(seed, index, image_size) for index in range(n)]


def _check_image_size(image_size: int) -> None:
    if image_size < 64:
        raise ValueError(f"image_size must be at least 64, got {image_size}")


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
    _KIND_TABLE[synth["kind"]].draw(ImageDraw.Draw(image), synth, image_size)
    return image


def _record(seed: int, index: int, image_size: int) -> dict[str, Any]:
    rng = random.Random(f"vlmrl.synth:{seed}:{index}")
    kind = _KIND_TABLE[KINDS[index % len(KINDS)]]
    answer_format = rng.choices(ANSWER_FORMATS, weights=ANSWER_FORMAT_WEIGHTS)[0]
    problem = build(kind, answer_format, rng)
    image = render(problem.synth, image_size)
    return assemble_record(kind, index, answer_format, problem, image, image_size)


def _read_record(seed: int, index: int, image_size: int) -> dict[str, Any]:
    rng = random.Random(f"vlmrl.synth_read:{seed}:{index}")  # the prototype's key: sets repeat
    problem = build(read.KIND, "integer", rng)
    image = render(problem.synth, image_size)
    return assemble_record(read.KIND, index, "integer", problem, image, image_size)
