"""The before/after report of post_eval: did training help, where, and on which questions.

A delta in accuracy hides what actually changed: +2 right can be +5 wrong→right and -3
right→wrong. So the report pairs the baseline and post records by pid and lists every flip with
both responses side by side, next to the headline and per-category numbers. It is written as
Markdown (for diffs and GitHub), as one self-contained HTML file (images inlined as base64, no
scripts, no external CSS: it opens offline and can be attached anywhere) and as PNG plots that
dvc.yaml declares, rendered with matplotlib's Agg canvas so no display or CDN is needed.

Records present on one side only are reported as such, never crashed on: an eval set that
changed between the two runs should show up in the report, not hide it.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.outputs import write_json_atomic, write_text_atomic
from vlmrl.reporting.tables import markdown_table

HEADLINE = (("accuracy", "Accuracy"), ("format_compliance", "Format compliance"),
            ("mean_reward", "Mean reward"))
PLOTTED_HEADLINE = ("accuracy", "format_compliance")
PLOT_BEFORE_AFTER = "accuracy_before_after.png"
PLOT_BY_CATEGORY = "accuracy_by_category.png"
BASELINE_NOTE = ("Baseline: the model GSPO starts from (the base model with the cold-start SFT "
                 "adapter, or the base model alone where SFT is off); post: with the GSPO "
                 "adapter.")
NO_CATEGORIES = "The eval set's records have no category."
FLIP_KINDS = ("wrong_to_right", "right_to_wrong")
MAX_RESPONSE_CHARS = 300
THUMBNAIL_PIXELS = 160

Record = Mapping[str, Any]


class BeforeAfter:
    """A row's `before` and `after` values and the change between them."""

    before: float | None
    after: float | None

    @property
    def delta(self) -> float | None:
        """after - before; None where either side has no value."""
        return None if self.before is None or self.after is None else self.after - self.before


@dataclass(frozen=True)
class HeadlineRow(BeforeAfter):
    """One headline metric (`HEADLINE`) before and after training."""

    key: str
    label: str
    before: float | None
    after: float | None


@dataclass(frozen=True)
class CategoryRow(BeforeAfter):
    """One category's accuracy over its `n` records, before and after training."""

    category: str
    n: int
    before: float | None
    after: float | None


@dataclass(frozen=True)
class Report:
    headline: list[HeadlineRow]
    categories: list[CategoryRow]
    flips: dict[str, list[str]]
    baseline: dict[str, Record]
    post: dict[str, Record]


# ----------------------------------------------------------------- comparison


def read_records(path: Path | str) -> list[dict[str, Any]]:
    path = Path(path)
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def by_pid(records: Sequence[Record]) -> dict[str, Record]:
    return {str(record["pid"]): record for record in records}


def find_flips(baseline_records: Sequence[Record],
               post_records: Sequence[Record]) -> dict[str, list[str]]:
    """Pids that went wrong→right and right→wrong, and pids present on one side only."""
    baseline, post = by_pid(baseline_records), by_pid(post_records)
    shared = [pid for pid in baseline if pid in post]
    return {
        "wrong_to_right": [p for p in shared if not baseline[p]["correct"] and post[p]["correct"]],
        "right_to_wrong": [p for p in shared if baseline[p]["correct"] and not post[p]["correct"]],
        "only_in_baseline": [pid for pid in baseline if pid not in post],
        "only_in_post": [pid for pid in post if pid not in baseline],
    }


def headline_rows(baseline_metrics: Record, post_metrics: Record) -> list[HeadlineRow]:
    return [HeadlineRow(key, label, baseline_metrics.get(key), post_metrics.get(key))
            for key, label in HEADLINE]


def accuracy(records: Sequence[Record]) -> float | None:
    return sum(bool(r["correct"]) for r in records) / len(records) if records else None


def category_rows(baseline: Mapping[str, Record], post: Mapping[str, Record]) -> list[CategoryRow]:
    """Per category, over the pids both runs evaluated, so before and after are comparable."""
    groups: dict[str, list[str]] = defaultdict(list)
    for pid, record in baseline.items():
        if pid in post and record.get("category") is not None:
            groups[str(record["category"])].append(pid)
    return [CategoryRow(name, len(pids), accuracy([baseline[p] for p in pids]),
                        accuracy([post[p] for p in pids]))
            for name, pids in sorted(groups.items())]


def build_report(baseline_records: Sequence[Record], post_records: Sequence[Record],
                 baseline_metrics: Record, post_metrics: Record) -> Report:
    baseline, post = by_pid(baseline_records), by_pid(post_records)
    return Report(headline_rows(baseline_metrics, post_metrics), category_rows(baseline, post),
                  find_flips(baseline_records, post_records), baseline, post)


# ------------------------------------------------------------------ formatting


def number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def truncate(text: Any, limit: int = MAX_RESPONSE_CHARS) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= limit else text[:limit] + f"… [{len(text) - limit} more chars]"


def html_cell(text: Any) -> str:
    return html.escape(truncate(text)).replace("\n", "<br>")


# -------------------------------------------------------------------- markdown


def headline_markdown(report: Report) -> list[str]:
    rows = [[r.label, number(r.before), number(r.after), signed(r.delta)] for r in report.headline]
    return markdown_table(["metric", "baseline", "post", "delta"], rows,
                          ["left", "right", "right", "right"]).splitlines()


def category_markdown(report: Report) -> list[str]:
    if not report.categories:
        return [NO_CATEGORIES]
    rows = [[r.category, str(r.n), number(r.before), number(r.after), signed(r.delta)]
            for r in report.categories]
    return markdown_table(["category", "n", "baseline", "post", "delta"], rows,
                          ["left", "right", "right", "right", "right"]).splitlines()


def flip_markdown(report: Report, kind: str) -> list[str]:
    pids = report.flips[kind]
    if not pids:
        return ["None."]
    rows = [[pid, report.baseline[pid].get("gold"), truncate(report.baseline[pid].get("response")),
             truncate(report.post[pid].get("response"))] for pid in pids]
    return markdown_table(["pid", "gold", "baseline response", "post response"], rows).splitlines()


def unmatched_lines(report: Report) -> list[str]:
    lines = []
    for kind, side in (("only_in_baseline", "baseline"), ("only_in_post", "post")):
        if report.flips[kind]:
            pids = ", ".join(report.flips[kind])
            lines.append(f"Evaluated only in the {side} run (left out of the comparison): {pids}")
    return lines


def render_markdown(report: Report) -> str:
    lines = ["# Evaluation: baseline vs post-training", "", BASELINE_NOTE, "",
             *headline_markdown(report), "",
             f"![accuracy before and after]({PLOT_BEFORE_AFTER})", "", "## By category", "",
             *category_markdown(report), "", f"![accuracy by category]({PLOT_BY_CATEGORY})", ""]
    for kind, title in (("wrong_to_right", "Wrong → right"), ("right_to_wrong", "Right → wrong")):
        lines += [f"## {title} ({len(report.flips[kind])})", "", *flip_markdown(report, kind), ""]
    extra = unmatched_lines(report)
    if extra:
        lines += ["## Unmatched records", "", *[f"- {line}" for line in extra], ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------ html

HTML_STYLE = """body{font-family:sans-serif;margin:2em;max-width:80em}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;
vertical-align:top;text-align:left}td.num{text-align:right}td.response{font-family:monospace;
white-space:pre-wrap;max-width:30em;word-break:break-word}img.plot{max-width:45%}"""


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def thumbnail_png(image) -> bytes:
    thumbnail = image.convert("RGB").copy()
    thumbnail.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
    buffer = io.BytesIO()
    thumbnail.save(buffer, format="PNG")
    return buffer.getvalue()


def html_table(header: Sequence[str], rows: Sequence[Sequence[tuple[str, str]]]) -> str:
    """`rows` hold (css class, already escaped html) per cell."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td class="{cls}">{cell}</td>' for cls, cell in row)
                   + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def headline_html(report: Report) -> str:
    rows = [[("", html.escape(r.label)), ("num", number(r.before)), ("num", number(r.after)),
             ("num", signed(r.delta))] for r in report.headline]
    return html_table(["metric", "baseline", "post", "delta"], rows)


def category_html(report: Report) -> str:
    if not report.categories:
        return f"<p>{NO_CATEGORIES}</p>"
    rows = [[("", html.escape(r.category)), ("num", str(r.n)), ("num", number(r.before)),
             ("num", number(r.after)), ("num", signed(r.delta))] for r in report.categories]
    return html_table(["category", "n", "baseline", "post", "delta"], rows)


def flip_html(report: Report, kind: str, thumbnails: Mapping[str, bytes]) -> str:
    pids = report.flips[kind]
    if not pids:
        return "<p>None.</p>"
    rows = []
    for pid in pids:
        image = thumbnails.get(pid)
        picture = f'<img alt="{html.escape(pid)}" src="{png_data_uri(image)}">' if image else ""
        rows.append([("", picture), ("", html.escape(pid)),
                     ("", html_cell(report.baseline[pid].get("gold"))),
                     ("response", html_cell(report.baseline[pid].get("response"))),
                     ("response", html_cell(report.post[pid].get("response")))])
    return html_table(["image", "pid", "gold", "baseline response", "post response"], rows)


def render_html(report: Report, plots: Mapping[str, bytes], thumbnails: Mapping[str, bytes]) -> str:
    images = "".join(f'<img class="plot" alt="{html.escape(name)}" src="{png_data_uri(png)}">'
                     for name, png in plots.items())
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>Evaluation: baseline vs post-training</title>",
             f"<style>{HTML_STYLE}</style></head><body>",
             "<h1>Evaluation: baseline vs post-training</h1>", f"<p>{BASELINE_NOTE}</p>",
             headline_html(report),
             f"<p>{images}</p>", "<h2>By category</h2>", category_html(report)]
    for kind, title in (("wrong_to_right", "Wrong → right"), ("right_to_wrong", "Right → wrong")):
        parts += [f"<h2>{title} ({len(report.flips[kind])})</h2>",
                  flip_html(report, kind, thumbnails)]
    extra = unmatched_lines(report)
    if extra:
        parts += ["<h2>Unmatched records</h2><ul>",
                  *[f"<li>{html.escape(line)}</li>" for line in extra], "</ul>"]
    return "\n".join([*parts, "</body></html>", ""])


# ----------------------------------------------------------------------- plots


def figure_png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def grouped_bars(labels: Sequence[str], before: Sequence[float | None],
                 after: Sequence[float | None], title: str) -> bytes:
    """Baseline and post bars per label, on a 0–1 scale; a missing value is drawn as 0."""
    from matplotlib.figure import Figure  # the Agg canvas: no display, no pyplot state

    figure = Figure(figsize=(max(5.0, 1.3 * len(labels) + 2), 4))
    axes = figure.add_subplot()
    positions = range(len(labels))
    width = 0.38
    for offset, values, name in ((-width / 2, before, "baseline"), (width / 2, after, "post")):
        bars = axes.bar([p + offset for p in positions], [v or 0.0 for v in values], width,
                        label=name)
        axes.bar_label(bars, labels=[number(v) for v in values], fontsize=8)
    axes.set_xticks(list(positions), labels, rotation=20 if len(labels) > 3 else 0, ha="right"
                    if len(labels) > 3 else "center")
    axes.set_ylim(0, 1.1)
    axes.set_title(title)
    axes.legend()
    return figure_png(figure)


def render_plots(report: Report) -> dict[str, bytes]:
    shown = [r for r in report.headline if r.key in PLOTTED_HEADLINE]
    categories = report.categories
    return {
        PLOT_BEFORE_AFTER: grouped_bars([r.label for r in shown], [r.before for r in shown],
                                        [r.after for r in shown],
                                        "Accuracy and format compliance"),
        PLOT_BY_CATEGORY: grouped_bars([c.category for c in categories],
                                       [c.before for c in categories],
                                       [c.after for c in categories], "Accuracy by category"),
    }


# ----------------------------------------------------------------------- write


def write_report(report_dir: Path | str, baseline_records: Sequence[Record],
                 post_records: Sequence[Record], baseline_metrics: Record, post_metrics: Record,
                 images: Mapping[str, Any] | None = None) -> Report:
    """Writes report.md, report.html, the two plots and flips.json into `report_dir`.
    `images` maps pid -> PIL image; flipped records get a thumbnail in the HTML."""
    report = build_report(baseline_records, post_records, baseline_metrics, post_metrics)
    flipped = {pid for kind in FLIP_KINDS for pid in report.flips[kind]}
    thumbnails = {pid: thumbnail_png(image) for pid, image in (images or {}).items()
                  if pid in flipped and image is not None}  # text-only records have none
    plots = render_plots(report)
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    for name, png in plots.items():
        (report_dir / name).write_bytes(png)
    write_text_atomic(report_dir / "report.md", render_markdown(report))
    write_text_atomic(report_dir / "report.html", render_html(report, plots, thumbnails))
    write_json_atomic(report_dir / "flips.json", report.flips)
    return report


def comparison_metrics(report: Report) -> dict[str, Any]:
    """Deltas and flip counts for the post metrics file, so `dvc metrics show` carries them."""
    return {**{f"{row.key}_delta": row.delta for row in report.headline},
            **{kind: len(pids) for kind, pids in report.flips.items()}}
