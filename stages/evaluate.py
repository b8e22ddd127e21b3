"""DVC stages baseline_eval and post_eval: score the base model, or the model with the trained
adapter, on the prepared eval set; post also writes the before/after report.

Thin on purpose: the work is in vlmrl.evaluation.evaluate and vlmrl.evaluation.report. Where `eval.num_processes`
resolves to more than one (`auto`: one per GPU, on a host with several) the script relaunches itself
under `accelerate launch` (vlmrl.distributed.launch); rank 0 writes. The decision comes before torch is imported
(vlmrl.evaluation.evaluate imports it), so one process on a host with several GPUs keeps to one of them.
Every output appears atomically, and a failed run leaves the earlier ones as they were
(vlmrl.outputs.stage_outputs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vlmrl.distributed.launch import (
    die_with_launcher,
    evaluation_launch,
    evaluation_plan,
    finish_launched,
    is_main_process,
    launched_worker,
    run_launched,
)
from vlmrl.errors import run_stage
from vlmrl.evaluation.report import comparison_metrics, find_flips, read_records, write_report
from vlmrl.outputs import (
    atomic_dir,
    stage_outputs,
    stage_parser,
    write_json_atomic,
    write_jsonl_atomic,
)
from vlmrl.params import Params, load_params
from vlmrl.reporting.metrics import category_rows, write_stage_metrics
from vlmrl.rewards.answer_format import answer_format

POST_ONLY = ("adapter", "baseline", "baseline_metrics", "report")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The stage's command line (`sys.argv` where `argv` is None): the mode, then its paths;
    post's paths are required in post and refused in baseline, `--start-adapter` the reverse."""
    parser = stage_parser(__doc__.splitlines()[0], timings=True)
    parser.add_argument("mode", choices=("baseline", "post"))
    parser.add_argument("--eval-set", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="directory for records.jsonl")
    parser.add_argument("--by-category", type=Path, required=True,
                        help="accuracy per category (a JSON list, for dvc plots)")
    parser.add_argument("--adapter", type=Path)
    parser.add_argument("--start-adapter", type=Path,
                        help="baseline: the sft_cold_start stage's output; the baseline is the "
                             "model GSPO starts from (base + SFT adapter, or the base model "
                             "where that SFT was a pass-through)")
    parser.add_argument("--baseline", type=Path, help="baseline records.jsonl")
    parser.add_argument("--baseline-metrics", type=Path)
    parser.add_argument("--report", type=Path, help="report directory")
    args = parser.parse_args(argv)
    given = [name for name in POST_ONLY if getattr(args, name) is not None]
    if args.mode == "post" and len(given) != len(POST_ONLY):
        missing = sorted(set(POST_ONLY) - set(given))
        parser.error("post needs " + ", ".join("--" + m.replace("_", "-") for m in missing))
    if args.mode == "post" and args.start_adapter is not None:
        parser.error("--start-adapter belongs to baseline; post evaluates --adapter")
    if args.mode == "baseline" and given:
        parser.error("baseline evaluates the starting model (--start-adapter); "
                     + ", ".join("--" + g.replace("_", "-") for g in given) + " belong to post")
    return args


def check_baseline_inputs(args: argparse.Namespace) -> None:
    """Stops post_eval before any model loads where baseline_eval's records or metrics are
    missing, naming the file and the stage that makes it."""
    for path in (args.baseline, args.baseline_metrics):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found; the baseline_eval stage makes it "
                                    f"(dvc repro baseline_eval)")


def load_baseline(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """baseline_eval's records and headline metrics, which the report compares post against."""
    import json

    return read_records(args.baseline), json.loads(args.baseline_metrics.read_text(encoding="utf-8"))


def flipped_images(eval_set: Path, pids: set[str]) -> dict[str, Any]:
    """The images of the eval records `pids` (the flipped ones the report shows), by pid; only
    those rows are decoded."""
    from datasets import load_from_disk

    dataset = load_from_disk(str(eval_set))
    indices = [i for i, pid in enumerate(dataset["pid"]) if pid in pids]
    return {row["pid"]: row["image"] for row in dataset.select(indices)}


def write_post_report(args: argparse.Namespace, records: list[dict[str, Any]],
                      metrics: dict[str, Any]) -> dict[str, Any]:
    """Writes post_eval's before/after report into `args.report` (atomically) and returns post's
    metrics with the deltas against the baseline (`vs_baseline`).

    Args:
        args: the command line, for the baseline's files, the eval set and the report folder.
        records: post's scored records, one per eval item.
        metrics: post's metrics as the evaluation computed them.
    """
    baseline_records, baseline_metrics = load_baseline(args)
    flips = find_flips(baseline_records, records)
    images = flipped_images(args.eval_set, set(flips["wrong_to_right"] + flips["right_to_wrong"]))
    with atomic_dir(args.report) as staging:
        report = write_report(staging, baseline_records, records, baseline_metrics, metrics, images)
    return {**metrics, "vs_baseline": comparison_metrics(report)}


def evaluate(args: argparse.Namespace, params: Params) -> dict[str, Any] | None:
    """Runs the evaluation of `args.mode` (the starting model, or base + `--adapter`) and writes
    its records, per-category accuracy, metrics and, in post, the report; returns the metrics,
    or None on a rank other than 0 of a launched run (rank 0 writes)."""
    from vlmrl.evaluation.evaluate import run_evaluation  # torch: once the GPUs are chosen
    from vlmrl.models.loading import starting_adapter

    if args.mode == "post":
        check_baseline_inputs(args)
    adapter = args.adapter if args.mode == "post" else starting_adapter(args.start_adapter)
    result = run_evaluation(args.eval_set, params.model, params.eval, params.rewards,
                            adapter=adapter, fmt=answer_format(params))
    if result is None:
        return None  # another rank of a launched run: rank 0 writes
    records, metrics = result
    if args.mode == "post":
        metrics = write_post_report(args, records, metrics)
    write_jsonl_atomic(args.out / "records.jsonl", records)
    write_json_atomic(args.by_category, category_rows(metrics))
    write_stage_metrics(f"{args.mode}_eval", metrics, metrics=args.metrics, details=args.details,
                        timings=args.timings)
    return metrics


def main(argv: list[str] | None = None) -> int:
    """The stage: in this process, or relaunched with one process per GPU where `eval` params
    ask for several; every output appears at once or not at all. Returns the exit status."""
    args = parse_args(argv)
    outputs = [args.out / "records.jsonl", args.metrics, args.details, args.by_category,
               args.timings, *([args.report] if args.report else [])]
    params = load_params(args.params)  # a bad param fails here, before any file moves
    launch = evaluation_launch(evaluation_plan(params.eval.num_processes, params.model,
                                               f"{args.mode}_eval"))
    if launch is not None and not launched_worker():
        finish_launched(run_launched(launch, __file__, sys.argv[1:] if argv is None else argv),
                        outputs)
        return 0
    die_with_launcher()
    with stage_outputs(*outputs, owner=is_main_process()):
        metrics = evaluate(args, params)
    if metrics is None:
        return 0
    print(f"{args.mode}_eval: {metrics['n']} records, accuracy {metrics['accuracy']:.3f}, "
          f"format compliance {metrics['format_compliance']:.3f}, mean reward "
          f"{metrics['mean_reward']:.3f}, {metrics['samples_per_second']:.2f} samples/s, "
          f"{metrics['generated_tokens_per_second']:.1f} generated tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_stage("_".join([*sys.argv[1:2], "eval"]), main))
