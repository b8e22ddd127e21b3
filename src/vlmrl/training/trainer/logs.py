"""Training logs: a trainer's log history (GRPOTrainer's and SFTTrainer's) flattened into rows
for DVC plots, written at every logging step so a long run can be watched, and the file TRL's
sample completions table goes to instead of stdout (vlmrl.training.trainer.trainers). No torch at import."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmrl.outputs import write_json_atomic

SAMPLES_HEADER = ("Sample completions of each logging step (train.grpo.log_completions, "
                  "num_completions_to_print)\n")


def step_log_rows(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trainer log entries as flat rows for DVC plots ('clip_ratio/region_mean' ->
    'clip_ratio_region_mean')."""
    rows = []
    for entry in log_history:
        if "step" not in entry or "train_runtime" in entry:
            continue
        row = {"step": entry["step"]}
        for key, value in entry.items():
            if isinstance(value, (int, float)) and key != "step":
                row[flat_key(key)] = value
        rows.append(row)
    return rows


def flat_key(key: str) -> str:
    return key.replace("/", "_").replace("-", "_")


def finite_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without NaN or infinite values, which JSON and DVC's plots do not take."""
    return [{key: value for key, value in row.items()
             if not (isinstance(value, float) and not math.isfinite(value))} for row in rows]


def live_log(path: Path, rows_of: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
             on_save: Callable[[list[dict[str, Any]]], None] | None = None):
    """A trainer callback that rewrites `path` (a JSON list of rows, which `dvc plots` reads;
    it reads no JSON lines) with every row so far at each logging step, and calls `on_save`
    with them at each checkpoint save. A resumed run's history comes back with its checkpoint,
    so the file always holds the whole run."""
    from transformers import TrainerCallback  # lazily: this module must import without torch

    class LiveLog(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                write_json_atomic(path, rows_of(state.log_history))

        def on_save(self, args, state, control, **kwargs):
            if on_save is not None and state.is_world_process_zero:
                on_save(rows_of(state.log_history))

    return LiveLog()


def start_completions_table(path: Path) -> None:
    """Creates the sample completions file with its header line, at once: the stage's declared
    output then exists even with `log_completions` off."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SAMPLES_HEADER, encoding="utf-8")
