"""`dvc plots show` renders offline: set-up (.ci/install-vega) puts Vega's scripts inline in the
page DVC writes, so every chart of dvc.yaml's plots renders in headless Chromium with all network
refused, and the PNG plots (the training curves, 2000 px wide) fit the page.

The plots' data is written by the project's own writers where it has them (the training curves,
the report's bar charts) and as the stages' JSON lists otherwise, in a real git + DVC copy of the
project configured as set-up configures the checkout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run
from project_repo import make_project_repo
from test_ui_browser import CHROMIUM, CHROMIUM_ARGS, TIMEOUT_MS

from vlmrl.evaluation.report import grouped_bars

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Chromium not installed: apt-get install chromium chromium-driver")

STEPS = range(1, 7)


def configured_template() -> Path:
    """The page set-up made and pointed this checkout's DVC at."""
    found = run(["dvc", "config", "--local", "plots.html_template"], ROOT, check=False)
    assert found.returncode == 0 and found.stdout.strip(), (
        "set-up has not configured the offline plots page: bash .ci/setup (.ci/install-vega)")
    return ROOT / ".dvc" / found.stdout.strip()


def write_json(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))


def write_plot_inputs(repo: Path) -> None:
    from vlmrl.training.gspo import plot_training_curves

    train_log = [{"step": step, "reward": 0.1 * step, "reward_std": 0.5, "loss": 0.01 * step,
                  "grad_norm": 1.0 / step, "clip_ratio_region_mean": 0.05,
                  "frac_reward_zero_std": 0.25, "completions_mean_length": 20 + step}
                 for step in STEPS]
    write_json(repo / "data/metrics/train_log.json", train_log)
    write_json(repo / "data/metrics/sft_log.json", [{"step": s, "loss": 2.0 / s} for s in STEPS])
    for name, accuracy in (("baseline", 0.25), ("post", 0.5)):
        write_json(repo / f"data/plots/{name}_eval_by_category.json",
                   [{"category": "bar chart", "accuracy": accuracy},
                    {"category": "table", "accuracy": accuracy / 2}])
    plot_training_curves(train_log, repo / "data/reports/train_curves.png")
    report = repo / "data/reports/eval"
    report.mkdir(parents=True)
    for name in ("accuracy_before_after.png", "accuracy_by_category.png"):
        (report / name).write_bytes(grouped_bars(["a", "b"], [0.2, 0.4], [0.3, 0.5], name))


@pytest.fixture
def plots_page(tmp_path: Path) -> Path:
    """dvc_plots/index.html of a project repo set up as set-up sets up the checkout."""
    template = configured_template()
    repo = make_project_repo(tmp_path / "repo")
    target = repo / ".dvc" / template.relative_to(ROOT / ".dvc")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, target)
    run(["dvc", "config", "--local", "plots.html_template",
         str(target.relative_to(repo / ".dvc"))], repo)
    write_plot_inputs(repo)
    run(["dvc", "plots", "show"], repo)
    return repo / "dvc_plots" / "index.html"


def test_plots_page_renders_every_chart_offline(plots_page: Path) -> None:
    from playwright.sync_api import sync_playwright

    definitions = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    declared = [d for d in definitions if isinstance(d, dict)]  # Vega charts; the rest are PNGs
    images = [d for d in definitions if isinstance(d, str)]
    refused: list[str] = []
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(TIMEOUT_MS)
        page.on("pageerror", lambda error: errors.append(str(error)))

        def offline(route) -> None:
            if route.request.url.startswith("file://"):
                route.continue_()
            else:
                refused.append(route.request.url)
                route.abort()

        page.route("**/*", offline)
        page.goto(plots_page.as_uri())
        page.wait_for_function(
            "() => document.querySelectorAll('.vega-embed canvas, .vega-embed svg.marks')"
            f".length >= {len(declared)}")
        charts = page.locator(".vega-embed canvas, .vega-embed svg.marks").count()
        page.wait_for_function("() => [...document.images].every(i => i.complete)")
        sizes = page.evaluate("""() => [...document.images].map(i => ({
            src: i.getAttribute('src'), natural: i.naturalWidth,
            right: i.getBoundingClientRect().right,
            page: document.documentElement.clientWidth}))""")
        scrolls = page.evaluate("() => document.documentElement.scrollWidth"
                                " > document.documentElement.clientWidth")
        browser.close()
    assert charts == len(declared) == 7
    assert not errors and not refused, (errors, refused)
    assert len(sizes) == len(images) == 3 and all(size["natural"] > 0 for size in sizes)
    curves = next(size for size in sizes if "train_curves" in size["src"])
    assert curves["natural"] > curves["page"]  # wider than the page, scaled to fit it
    assert all(size["right"] <= size["page"] for size in sizes), sizes
    assert not scrolls
