"""benchmarks/learning.py decides whether the product's central claim holds; its arithmetic and
its reading of the train log are checked here on hand-made runs (the runs themselves take
minutes each and are the benchmark's job)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import benchmark_fixture

learning = benchmark_fixture("learning")


def run(seed: int, format_delta: float, reward_delta: float) -> dict:
    return {"seed": seed, "seconds": 1.0, "n_eval": 32,
            "mechanics": {"min_grad_norm": 0.5, "off_policy_clip_min": 0.2,
                          "off_policy_clip_max": 0.6, "mean_frac_reward_zero_std": 0.1},
            "format_compliance": {"baseline": 0.4, "post": 0.4 + format_delta,
                                  "delta": format_delta},
            "accuracy": {"baseline": 0.0, "post": 0.0, "delta": 0.0},
            "mean_reward": {"baseline": 1.0, "post": 1.0 + reward_delta, "delta": reward_delta},
            "accuracy_by_tier": {"read": {"baseline": 0.0, "post": 0.5}}}


def test_claim_holds_only_when_every_seed_gains_and_the_mean_beats_its_error(learning):
    assert learning.summarize([run(1, 0.2, 0.3), run(2, 0.25, 0.2), run(3, 0.3, 0.1)]
                              )["claim"]["holds"]
    one_seed_down = learning.summarize([run(1, 0.4, 0.3), run(2, -0.01, 0.2), run(3, 0.3, 0.1)]
                                       )["claim"]
    assert not one_seed_down["every_seed_format_gain"] and not one_seed_down["holds"]
    reward_down = learning.summarize([run(1, 0.2, 0.3), run(2, 0.25, -0.1), run(3, 0.3, 0.1)]
                                     )["claim"]
    assert not reward_down["every_seed_reward_gain"] and not reward_down["holds"]
    small = learning.summarize([run(1, 0.11, 0.3), run(2, 0.12, 0.2), run(3, 0.13, 0.1)])["claim"]
    assert small["every_seed_format_gain"] and not small["mean_gain_large_enough"]
    # mean 0.3667, std 0.4688, standard error 0.2706: 1.4 standard errors
    spread = learning.summarize([run(1, 0.02, 0.3), run(2, 0.9, 0.2), run(3, 0.18, 0.1)])["claim"]
    assert spread["mean_gain_large_enough"] and not spread["mean_gain_beats_its_standard_error"]
    assert spread["standard_error"] == pytest.approx(0.2706, abs=1e-4) and not spread["holds"]


def test_mechanics_read_off_policy_clip_from_steps_without_a_reward(learning):
    rows = [{"step": 1, "reward": 1.0, "grad_norm": 0.8, "clip_ratio_region_mean": 0.0,
             "frac_reward_zero_std": 0.25},
            {"step": 2, "grad_norm": 0.3, "clip_ratio_region_mean": 0.5},
            {"step": 3, "reward": 1.2, "grad_norm": 0.6, "clip_ratio_region_mean": 0.0,
             "frac_reward_zero_std": 0.75},
            {"step": 4, "grad_norm": 0.4, "clip_ratio_region_mean": 0.25}]
    assert learning.train_mechanics(rows) == {
        "min_grad_norm": 0.3, "off_policy_clip_min": 0.25, "off_policy_clip_max": 0.5,
        "mean_frac_reward_zero_std": 0.5}


def test_table_goes_between_the_markers_and_nowhere_else(learning, tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("intro\n<!-- benchmarks/learning.py:begin -->\nOLD TABLE\n"
                   "<!-- benchmarks/learning.py:end -->\ntail\n")
    runs = [run(1, 0.2, 0.3), run(2, 0.25, 0.2)]
    results = {"date": "2026-11-23", "machine": "test", "overrides": {}, "runs": runs,
               "summary": learning.summarize(runs)}
    learning.write_doc_block(doc, learning.render_table(results), "")
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("tail\n") and "OLD TABLE" not in text
    assert "0.400 → 0.600 (+20.0)" in text and "**holds**" in text
    with pytest.raises(SystemExit, match="markers"):
        learning.write_doc_block(tmp_path / "benchmarks.md", "x", ":gpu")


def test_override_needs_key_and_value(learning):
    assert learning.parse_override("model.load_in_4bit=true") == ("model.load_in_4bit", True)
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        learning.parse_override("model.load_in_4bit")


def test_readme_line_gives_the_range_over_seeds(learning, tmp_path: Path):
    runs = [run(1, 0.2, 0.3), run(2, 0.35, 0.1), run(3, 0.25, 0.2)]
    results = {"date": "2026-11-26", "runs": runs}
    line = learning.range_line(results)
    assert line.startswith("format compliance rose on 3 of 3 seeds, by +20.0 to +35.0 points "
                           "(mean +26.7), and mean reward on 3 of 3, by +0.10 to +0.30")
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- benchmarks/learning.py:begin:readme -->\nold\n"
                      "<!-- benchmarks/learning.py:end:readme -->\nb\n")
    learning.write_doc_block(readme, line, ":readme")
    assert "old" not in readme.read_text() and line in readme.read_text()


def test_indented_block_keeps_its_indentation(learning, tmp_path: Path):
    """A block inside a list item (README.md) stays inside it."""
    readme = tmp_path / "README.md"
    readme.write_text("- item\n  <!-- benchmarks/learning.py:begin:readme -->\n  old\n"
                      "  <!-- benchmarks/learning.py:end:readme -->\n  more\n")
    learning.write_doc_block(readme, "  new", ":readme")
    assert readme.read_text() == ("- item\n  <!-- benchmarks/learning.py:begin:readme -->\n  new\n"
                                  "  <!-- benchmarks/learning.py:end:readme -->\n  more\n")
