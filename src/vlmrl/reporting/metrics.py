"""What `dvc metrics show` lists: per stage, only the numbers people compare between runs.
A metrics file with text details or timings makes `dvc metrics show` one 7,000-character row
and `dvc exp show` hundreds of columns, so each stage writes three files:
the headline numbers (declared as DVC metrics; later stages may depend on them), the full
details (checks, per-source breakdowns, names; a plain output no stage depends on) and the
wall-clock timings (`vlmrl.reporting.timing`; nothing depends on them either)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vlmrl.outputs import write_json_atomic
from vlmrl.reporting.timing import split_wall_clock

# Dotted key paths of each stage's headline numbers; a mapping is kept whole (all its values
# must be numbers). A key a run does not produce (post_eval's comparison in baseline_eval, a
# mean over no steps) is left out rather than written as null.
_EVAL = ("n", "accuracy", "format_compliance", "mean_reward", "rewards", "score_errors",
         "mean_generated_tokens", "accuracy_by_tier", "vs_baseline.accuracy_delta",
         "vs_baseline.format_compliance_delta", "vs_baseline.mean_reward_delta",
         "vs_baseline.wrong_to_right", "vs_baseline.right_to_wrong")
HEADLINE: dict[str, tuple[str, ...]] = {
    "prepare_data": ("total_records", "filtered_out", "skipped", "train.n", "eval.n"),
    "sft_cold_start": ("steps", "first_loss", "last_loss", "nonfinite_steps"),
    "baseline_eval": _EVAL,
    "post_eval": _EVAL,
    "train_gspo": ("steps", "mean_reward", "last_reward", "last_clip_ratio", "max_clip_ratio",
                   "steps_with_clipping", "last_completion_length", "min_grad_norm",
                   "last_grad_norm", "steps_with_zero_grad_norm", "mean_frac_reward_zero_std",
                   "nonfinite_steps"),
    "verify_lora": ("checks_failed", "tensors.adapted_modules", "tensors.zero_lora_B",
                    "tensors.parameters", "logit_delta.max_abs", "logit_delta.mean_abs"),
    "export": ("checks_failed", "logit_max_abs_diff"),
    "upload": ("files", "uploaded_files", "skipped_files", "uploaded_bytes", "total_bytes"),
}


def is_number(value: Any) -> bool:
    """A finite int or float; a bool is not one (DVC would show True, and diff it as 1)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _lookup(result: Mapping[str, Any], path: str) -> Any:
    value: Any = result
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _numbers_only(value: Any, path: str) -> Any:
    if isinstance(value, Mapping):
        return {str(key): _numbers_only(item, f"{path}.{key}") for key, item in value.items()
                if item is not None}
    if not is_number(value):
        raise ValueError(f"headline metric {path} is {value!r}, not a finite number")
    return value


def headline(stage: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """The stage's headline numbers out of its full result, nested as in the result."""
    picked: dict[str, Any] = {}
    for path in HEADLINE[stage]:
        value = _lookup(result, path)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        *parents, leaf = path.split(".")
        target = picked
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = _numbers_only(value, path)
    return picked


def category_rows(metrics: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An evaluation's accuracy per category as rows for `dvc plots` (a bar per category, one
    colour per file: baseline and post side by side)."""
    by_category = metrics.get("accuracy_by_category") or {}
    return [{"category": str(name), "accuracy": value}
            for name, value in sorted(by_category.items()) if is_number(value)]


def write_stage_metrics(stage: str, result: Mapping[str, Any], *, metrics: Path, details: Path,
                        timings: Path | None = None) -> None:
    """Writes the headline numbers, the details (the result less its wall-clock figures) and,
    where the stage has a timings file, the wall-clock figures."""
    kept, times = split_wall_clock(result)
    write_json_atomic(details, kept)
    if timings is not None:
        write_json_atomic(timings, times)
    write_json_atomic(metrics, headline(stage, kept))


def leaves(payload: Any, path: str = "") -> list[tuple[str, Any]]:
    """(dotted path, value) of every leaf of a JSON payload, for checks that a metrics file
    holds numbers only."""
    if isinstance(payload, Mapping):
        return [leaf for key, value in payload.items()
                for leaf in leaves(value, f"{path}.{key}" if path else str(key))]
    return [(path, payload)]
