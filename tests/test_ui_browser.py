"""End to end: `vlmrl ui` as users start it, driven in headless Chromium. Typing a completion
must show the numbers `score_completion` gives with the repo's params.yaml, bad input must show
the server's message, and the eval browser must filter flips. Screenshots are saved as
artifacts (in $VLMRL_TEST_ARTIFACTS when set, else pytest's tmp dir; the paths are printed)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import stop_process
from test_ui import (
    BASELINE,
    OPTIONS,
    POST,
    WEIGHTS,
    eval_set_dir,  # noqa: F401 - module fixture reused here
    link_eval_set,
    write_eval_outputs,
    write_params,
)

from vlmrl.rewards.functions import score_completion
from vlmrl.ui.example import worked_example

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
STARTUP_SECONDS = 60
TIMEOUT_MS = 30_000
# Typed key by key after a pasted start, so the debounce sees a burst of edits.
PASTED = "<REASONING>There are 3 red and 4 blue apples, 3 + 4 = 7.</REASONING>"
TYPED = "<SOLUTION>7</SOLUTION>"

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Chromium not installed: apt-get install chromium chromium-driver")


def read_url(server: subprocess.Popen) -> str:
    """The URL the server prints once it listens; fails with its output if it dies first."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        ready, _, _ = select.select([server.stdout], [], [], 1.0)
        if ready:
            line = server.stdout.readline()
            if "http://127.0.0.1:" in line:
                return "http://" + line.split("http://", 1)[1].split()[0]
        if server.poll() is not None:
            break
    server.kill()
    raise AssertionError(f"vlmrl ui did not start:\n{server.stdout.read()}")


@pytest.fixture
def ui_repo(tmp_path: Path, eval_set_dir: Path) -> Path:  # noqa: F811
    repo = tmp_path / "repo"
    repo.mkdir()
    write_params(repo, WEIGHTS, OPTIONS)
    write_eval_outputs(repo)
    link_eval_set(repo, eval_set_dir)
    return repo


@pytest.fixture
def server_url(ui_repo: Path) -> Iterator[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "vlmrl.cli", "ui", "--port", "0", "--repo", str(ui_repo)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        yield read_url(server)
    finally:
        stop_process(server, 10)


@pytest.fixture
def page(server_url: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(server_url)
        yield page
        browser.close()
        assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    target = Path(os.environ.get("VLMRL_TEST_ARTIFACTS") or tmp_path / "artifacts")
    target.mkdir(parents=True, exist_ok=True)
    return target


def screenshot(page, artifacts: Path, name: str) -> None:
    path = artifacts / name
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def wait_for_score(page, completion: str) -> None:
    page.wait_for_function(
        """chars => document.getElementById('score-status').textContent === 'up to date'
                    && document.getElementById('reward-total').dataset.chars === String(chars)""",
        arg=len(completion))


def shown_rewards(page) -> dict[str, tuple[str, str]]:
    """reward name -> (the value the server sent, the text on the page)."""
    rows = page.locator("#reward-table tbody tr")
    return {rows.nth(i).get_attribute("data-reward"):
            (rows.nth(i).locator("td.value").get_attribute("data-value"),
             rows.nth(i).locator("td.value").inner_text())
            for i in range(rows.count())}


def test_calculator_opens_with_the_worked_example_scored_and_the_weights_shown(page, artifacts):
    example = worked_example()
    wait_for_score(page, example["completion"])
    assert page.input_value("#completion") == example["completion"]
    assert page.input_value("#gold-answer") == example["record"]["answer"]
    assert example["record"]["question"] in page.inner_text("#record-question")

    expected = score_completion(example["completion"], example["record"], WEIGHTS, OPTIONS)
    shown = shown_rewards(page)
    assert list(shown) == list(WEIGHTS)
    for name, value in expected["rewards"].items():
        assert float(shown[name][0]) == value
    weight_cells = page.locator("#reward-table tbody td.weight")
    assert [float(weight_cells.nth(i).inner_text()) for i in range(len(WEIGHTS))] == list(
        WEIGHTS.values())
    assert float(page.get_attribute("#reward-total", "data-value")) == expected["total"]
    assert page.inner_text("#v-correct") == "yes"
    assert page.inner_text("#weights") == (
        "format_reward 0.5, correctness_reward 2, length_penalty 0.25")
    screenshot(page, artifacts, "ui_calculator_opened.png")


def test_calculator_shows_the_project_rewards_as_you_type(page, artifacts):
    page.wait_for_function("() => document.getElementById('record-pick').options.length > 1")
    page.select_option("#record-pick", label="p1 · 7 · How many apples in picture 0?")
    assert page.input_value("#gold-answer") == "7"
    page.fill("#completion", PASTED)
    page.locator("#completion").press_sequentially(TYPED, delay=20)
    completion = PASTED + TYPED
    wait_for_score(page, completion)

    record = {"answer": "7", "question_type": "free_form", "answer_type": "integer"}
    expected = score_completion(completion, record, WEIGHTS, OPTIONS)
    shown = shown_rewards(page)
    assert list(shown) == list(expected["rewards"])
    for name, value in expected["rewards"].items():
        assert float(shown[name][0]) == value
        assert float(shown[name][1]) == value
    assert float(page.get_attribute("#reward-total", "data-value")) == expected["total"]
    assert float(page.inner_text("#reward-total")) == pytest.approx(expected["total"], abs=1e-4)
    assert page.inner_text("#v-extracted") == "7"
    assert page.inner_text("#v-correct") == "yes"
    assert "min_chars 10" in page.inner_text("#options")
    screenshot(page, artifacts, "ui_calculator.png")


def test_calculator_shows_the_server_message_for_bad_input(page, artifacts):
    page.fill("#completion", "<SOLUTION>7</SOLUTION>")
    page.fill("#gold-precision", "two")
    page.wait_for_function("() => !document.getElementById('score-error').hidden")
    assert "record.precision" in page.inner_text("#score-error")
    assert page.inner_text("#reward-total") == "–"
    page.fill("#gold-precision", "")
    page.fill("#completion", "")
    page.wait_for_function(
        "() => document.getElementById('score-error').textContent"
        ".includes('completion is empty')")
    screenshot(page, artifacts, "ui_calculator_error.png")


def test_eval_browser_filters_flips_and_shows_images(page, artifacts):
    page.click("button[data-tab=eval]")
    page.wait_for_selector(".card[data-pid]")
    assert page.locator(".card").count() == 6
    accuracy = page.locator("#headline tr[data-metric=accuracy] td")
    assert [accuracy.nth(i).inner_text() for i in range(4)] == ["Accuracy", "0.4", "0.6", "+0.2"]

    page.select_option("#filter-change", "right_to_wrong")
    page.wait_for_function("() => document.querySelectorAll('.card').length === 1")
    assert page.get_attribute(".card", "data-pid") == "p2"
    assert BASELINE[1]["response"] in page.inner_text(".card [data-side=baseline] pre")

    page.select_option("#filter-change", "flipped")
    page.wait_for_function("() => document.querySelectorAll('.card').length === 2")
    page.wait_for_function("() => [...document.querySelectorAll('.card img')]"
                           ".every(img => img.complete && img.naturalWidth > 0)")
    screenshot(page, artifacts, "ui_eval_browser.png")

    page.click(".card[data-pid=p1] [data-side=post] button")
    wait_for_score(page, POST[0]["response"])
    assert page.inner_text("#v-correct") == "yes"


def test_eval_browser_names_the_stage_to_run_when_outputs_are_missing(ui_repo, page, artifacts):
    (ui_repo / "data/eval/post/records.jsonl").unlink()
    page.click("button[data-tab=eval]")
    page.wait_for_selector("#eval-error:not([hidden])")
    message = page.inner_text("#eval-error")
    assert "data/eval/post/records.jsonl" in message and "dvc repro post_eval" in message
    assert page.locator("#eval-body").is_hidden()
    screenshot(page, artifacts, "ui_eval_missing.png")
    write_eval_outputs(ui_repo)
    page.click("button[data-tab=calculator]")
    page.click("button[data-tab=eval]")
    page.wait_for_selector(".card[data-pid]")
    assert page.locator("#eval-error").is_hidden()
