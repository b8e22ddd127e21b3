"""Metrics files hold only headline numbers (details and timings apart),
the train log is written while training runs, TRL's sample completions go to a file, and
`dvc metrics show` / `dvc plots show` work on a reproduced repo with data in every plot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import dvc_env, dvc_repro, run
from transformers import TrainerState

from vlmrl.params import ParamsError
from vlmrl.reporting.metrics import category_rows, headline, is_number, leaves, write_stage_metrics
from vlmrl.training.trainer.config import check_report_to
from vlmrl.training.trainer.logs import live_log

# ------------------------------------------------------------------ unit: metric files


def test_headline_keeps_only_the_listed_numbers() -> None:
    result = {"n": 8, "accuracy": 0.5, "format_compliance": 1.0, "mean_reward": None,
              "rewards": {"format_reward": 1.0, "correctness_reward": 0.5},
              "accuracy_by_source": {"a": 1.0}, "adapter": "data/models/adapter",
              "vs_baseline": {"accuracy_delta": 0.25, "only_in_post": 0}}
    picked = headline("post_eval", result)
    assert picked == {"n": 8, "accuracy": 0.5, "format_compliance": 1.0,
                      "rewards": {"format_reward": 1.0, "correctness_reward": 0.5},
                      "vs_baseline": {"accuracy_delta": 0.25}}


def test_headline_refuses_text_where_a_number_belongs() -> None:
    with pytest.raises(ValueError, match="headline metric steps is 'four'"):
        headline("train_gspo", {"steps": "four"})
    with pytest.raises(ValueError, match="checks_failed is True"):
        headline("export", {"checks_failed": True})


def test_write_stage_metrics_splits_headline_details_and_timings(tmp_path: Path) -> None:
    result = {"steps": 4, "last_reward": 1.5, "resumed_from": "checkpoint-2",
              "runtime_seconds": 12.5, "step_seconds": [3.0, 3.1]}
    paths = {name: tmp_path / f"{name}.json" for name in ("metrics", "details", "timings")}
    write_stage_metrics("train_gspo", result, **paths)
    read = {name: json.loads(path.read_text()) for name, path in paths.items()}
    assert read["metrics"] == {"steps": 4, "last_reward": 1.5}
    assert read["details"] == {"steps": 4, "last_reward": 1.5, "resumed_from": "checkpoint-2"}
    assert read["timings"] == {"runtime_seconds": 12.5, "step_seconds": [3.0, 3.1]}


def test_category_rows_are_plot_rows() -> None:
    rows = category_rows({"accuracy_by_category": {"table": 0.5, "bar chart": 1.0, "x": None}})
    assert rows == [{"category": "bar chart", "accuracy": 1.0},
                    {"category": "table", "accuracy": 0.5}]


# ------------------------------------------------------------------ unit: live logging


def test_report_to_is_checked_with_its_key_path() -> None:
    check_report_to("none", "train.grpo.report_to")
    check_report_to(["none"], "sft.args.report_to")
    with pytest.raises(ParamsError, match="train.grpo.report_to: 'wandb' is not one of none"):
        check_report_to("wandb", "train.grpo.report_to")


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                    reason="tensorboard is installed here")
def test_report_to_an_uninstalled_backend_is_refused_before_loading() -> None:
    with pytest.raises(ParamsError, match="sft.args.report_to: tensorboard is not installed"):
        check_report_to(["tensorboard"], "sft.args.report_to")


def test_live_log_rewrites_the_log_at_every_logging_step(tmp_path: Path) -> None:
    path, saved = tmp_path / "log.json", []
    callback = live_log(path, lambda history: [dict(entry) for entry in history], saved.append)
    state = TrainerState()
    for step in (1, 2):
        state.log_history.append({"step": step, "reward": step / 2})
        callback.on_log(None, state, None)
        assert json.loads(path.read_text()) == state.log_history
    callback.on_save(None, state, None)
    assert saved == [[{"step": 1, "reward": 0.5}, {"step": 2, "reward": 1.0}]]


# ------------------------------------------------------------------ a reproduced repo


def dvc_json(repo: Path, *args: str):
    return json.loads(run(["dvc", *args, "--json"], repo).stdout)


@pytest.mark.slow
def test_metrics_show_lists_only_numbers(pipeline_repo: Path) -> None:
    dvc_repro(pipeline_repo, "upload")
    shown = dvc_json(pipeline_repo, "metrics", "show")
    ((_revision, workspace),) = shown.items()
    files = workspace["data"]
    stages = yaml.safe_load((pipeline_repo / "dvc.yaml").read_text())["stages"]
    declared = {entry if isinstance(entry, str) else next(iter(entry))
                for stage in stages.values() for entry in stage.get("metrics", [])}
    assert len(declared) == 8, declared
    assert {Path(name).name for name in files} == {Path(name).name for name in declared}
    for name, content in files.items():
        assert "error" not in content, (name, content)
        values = leaves(content["data"])
        assert values and all(is_number(value) for _, value in values), (name, values)
    post = json.loads((pipeline_repo / "data/metrics/post_eval.json").read_text())
    details = json.loads((pipeline_repo / "data/reports/details/post_eval.json").read_text())
    assert dict(leaves(post)).items() <= dict(leaves(details)).items()
    assert "accuracy_by_source" in details and "accuracy_by_source" not in post


def rendered_rows(plot: dict, file: str) -> list[dict]:
    """The rendered data points of one source file: DVC names the file in each point only
    where a plot draws several files."""
    values = plot["content"]["data"]["values"]
    if not any("filename" in row for row in values):
        return values
    return [row for row in values if row.get("filename") == Path(file).name]


@pytest.mark.slow
def test_plots_show_renders_every_plot_with_data(pipeline_repo: Path) -> None:
    dvc_repro(pipeline_repo, "post_eval")
    shown = dvc_json(pipeline_repo, "plots", "show")
    assert not shown.get("errors"), shown.get("errors")
    rendered = shown["data"]
    definitions = yaml.safe_load((pipeline_repo / "dvc.yaml").read_text())["plots"]
    for definition in definitions:
        if isinstance(definition, str):  # an image: DVC copies it into dvc_plots/
            (image,) = rendered[definition]
            assert image["type"] == "image" and Path(image["url"]).stat().st_size > 0
            continue
        ((title, spec),) = definition.items()
        (plot,) = rendered[title]
        assert plot["type"] == "vega", title
        for file, fields in spec["y"].items():
            rows = rendered_rows(plot, file)
            assert rows, f"plot {title!r}: no data points from {file}"
            for field in [fields] if isinstance(fields, str) else fields:
                column = [row.get(field) for row in rows]
                assert any(is_number(v) or isinstance(v, str) and v for v in column), (
                    f"plot {title!r}: no {field} values from {file}")
            assert all(is_number(row.get(spec["x"])) or isinstance(row.get(spec["x"]), str)
                       for row in rows), title


@pytest.mark.slow
def test_train_log_grows_while_training_and_samples_skip_stdout(pipeline_repo: Path,
                                                                tmp_path: Path) -> None:
    """The train stage run by hand (outputs in tmp_path): the log file is watched while the
    process runs and must hold some rows, but not all, at some point before it ends."""
    dvc_repro(pipeline_repo, "sft_cold_start")
    out = {name: tmp_path / name for name in
           ("adapter", "checkpoints", "train.json", "details.json", "log.json", "completions",
            "samples.txt", "curves.png", "timings.json")}
    cmd = [sys.executable, "stages/train_gspo.py", "--train-set", "data/prepared/train",
           "--start-adapter", "data/models/sft", "--out", str(out["adapter"]),
           "--checkpoints", str(out["checkpoints"]), "--metrics", str(out["train.json"]),
           "--details", str(out["details.json"]), "--log", str(out["log.json"]),
           "--completions", str(out["completions"]), "--samples", str(out["samples.txt"]),
           "--curves", str(out["curves.png"]), "--timings", str(out["timings.json"])]
    env = {**dvc_env(), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(cmd, cwd=pipeline_repo, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    while process.poll() is None:
        try:
            seen.add(len(json.loads(out["log.json"].read_text())))
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    output = process.stdout.read()
    assert process.returncode == 0, output[-3000:]
    final = json.loads(out["log.json"].read_text())
    assert [row["step"] for row in final] == [1, 2, 3, 4]
    assert any(0 < rows < len(final) for rows in seen), f"row counts seen while running: {seen}"
    assert "Step 1" not in output and "┏" not in output, output[-3000:]
    samples = out["samples.txt"].read_text(encoding="utf-8")
    assert "Step 1" in samples and "Advantage" in samples
    assert out["curves.png"].stat().st_size > 0
