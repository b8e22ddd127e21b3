"""What the Prefect flow shows of a finished stage besides its log: the artifacts a stage
publishes (metrics before and after, the adapter's verification, the release) and the table of
what DVC did with each stage, as Markdown and table rows built from the stage's own files."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmrl.reporting.tables import flatten, markdown_table

if TYPE_CHECKING:
    from vlmrl.pipeline.orchestration import StageReport

METRICS_DIR = Path("data") / "metrics"
DETAILS_DIR = Path("data") / "reports" / "details"  # what the metrics files leave out


def stage_metrics(repo: Path, name: str, folder: Path = METRICS_DIR) -> dict[str, Any]:
    return json.loads((repo / folder / f"{name}.json").read_text(encoding="utf-8"))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def before_after_markdown(baseline: Mapping[str, Any], post: Mapping[str, Any]) -> str:
    """Every numeric top-level metric the two evaluations share: baseline, post, change."""
    keys = [key for key, value in post.items()
            if _is_number(value) and _is_number(baseline.get(key))]
    rows = [(key, baseline[key], post[key], post[key] - baseline[key]) for key in keys]
    return "# Evaluation before and after GSPO\n\n" + markdown_table(
        ("metric", "baseline", "post", "change"), rows)


def verification_markdown(result: Mapping[str, Any]) -> str:
    """verify_lora.json: the verdict, one row per check, then the remaining fields."""
    verdict = result.get("passed")
    parts = ["# LoRA verification" + ("" if verdict is None else
                                      f": {'passed' if verdict else 'FAILED'}")]
    checks = result.get("checks")
    if isinstance(checks, Mapping):
        rows = [(name, check.get("passed"), check.get("detail", "")) if isinstance(check, Mapping)
                else (name, check, "") for name, check in checks.items()]
        parts.append(markdown_table(("check", "passed", "detail"), rows))
    rest = {key: value for key, value in result.items() if key not in {"passed", "checks"}}
    parts.append(markdown_table(("field", "value"), flatten(rest).items()))
    return "\n\n".join(parts)


def published_markdown(upload: Mapping[str, Any]) -> str:
    if upload.get("bucket"):
        where = f"`{upload.get('url') or 's3://' + upload['bucket'] + '/' + upload['prefix']}`"
    else:
        where = "nowhere: `upload.bucket` is empty, so only the manifest was written locally"
    rows = [(key, value) for key, value in upload.items()]
    return (f"# Published version `{upload.get('version')}`\n\nLocation: {where}\n\n"
            + markdown_table(("field", "value"), rows))


def stage_artifacts(stage: str, repo: Path) -> list[tuple[str, str, str]]:
    """(key, markdown, description) for the artifacts a finished stage publishes to Prefect."""
    if stage == "post_eval":
        return [("eval-before-after",
                 before_after_markdown(stage_metrics(repo, "baseline_eval"),
                                       stage_metrics(repo, "post_eval")),
                 "Evaluation metrics of the base model and of base + adapter")]
    if stage == "verify_lora":
        return [("lora-verification", verification_markdown(stage_metrics(repo, "verify_lora", DETAILS_DIR)),
                 "Checks that the LoRA adapter is trained and loads")]
    if stage == "upload":
        upload = stage_metrics(repo, "upload", DETAILS_DIR)
        return [("published-version", published_markdown(upload),
                 f"Release {upload.get('version')} and its S3 location")]
    return []


def stage_table(reports: Sequence[StageReport]) -> list[dict[str, Any]]:
    return [{"stage": report.stage, "outcome": report.outcome.value,
             "seconds": round(report.seconds, 1)} for report in reports]
