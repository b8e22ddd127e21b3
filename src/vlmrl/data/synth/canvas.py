"""The drawing floor every item kind shares: colours, the font, line widths, the title, the
value axis of charts, and fitting a shape into the image.

Why this exists: all kinds must look like one data set (same ink, same font, same proportions of
the image size), and the pixels must depend on nothing but the numbers drawn and `size`.

Deliberate choices:
- `default_font` is Pillow's bundled font, for the reason `vlmrl.data.synth` gives.
- Every length is a fraction of the image size, so a figure scales with the image.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

from PIL import ImageDraw, ImageFont

Font = ImageFont.FreeTypeFont | ImageFont.ImageFont

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


@lru_cache(maxsize=64)
def default_font(pixels: int) -> Font:
    return ImageFont.load_default(size=max(6, pixels))


def number_text(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.1f}"


def line_width(size: int) -> int:
    return max(1, round(size / 170))


def draw_title(draw: ImageDraw.ImageDraw, title: str, size: int) -> None:
    draw.text(
        (size / 2, size * 0.06),
        title,
        fill=INK,
        font=default_font(round(size * 0.042)),
        anchor="mm",
    )


def axis_scale(max_value: int) -> tuple[int, int]:
    """(axis top, tick step) with headroom above the largest value for its label."""
    step = next(step for step in (5, 10, 20, 25) if max_value / step <= 6)
    return step * (max_value // step + 1), step


def draw_value_axis(
    draw: ImageDraw.ImageDraw, box: tuple[float, float, float, float], max_value: int, size: int
) -> Callable[[float], float]:
    """Grid lines and tick labels; returns the value -> y pixel mapping."""
    left, top, right, bottom = box
    axis_top, step = axis_scale(max_value)

    def y_of(value: float) -> float:
        return bottom - value / axis_top * (bottom - top)

    font = default_font(round(size * 0.03))
    for tick in range(0, axis_top + 1, step):
        draw.line([(left, y_of(tick)), (right, y_of(tick))], fill=GRID, width=1)
        draw.text((left - size * 0.015, y_of(tick)), str(tick), fill=INK, font=font, anchor="rm")
    width = line_width(size)
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=INK, width=width)
    return y_of


def plot_box(size: int) -> tuple[float, float, float, float]:
    return size * 0.12, size * 0.13, size * 0.96, size * 0.84


def backed_text(
    draw: ImageDraw.ImageDraw,
    xy: tuple[float, float],
    text: str,
    font: Font,
    anchor: str,
) -> None:
    """Text on a white patch, so that a line running under a value label cannot hide a digit."""
    x0, y0, x1, y1 = draw.textbbox(xy, text, font=font, anchor=anchor)
    pad = max(1, (y1 - y0) // 5)
    draw.rectangle([x0 - pad, y0 - pad, x1 + pad, y1 + pad], fill=BACKGROUND)
    draw.text(xy, text, fill=INK, font=font, anchor=anchor)


def fit(
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
