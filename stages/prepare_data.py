"""prepare_data: records from data.source (embedded, a local file or directory at data.path, or a
hub dataset) -> MathVista-schema rows with prompts and images (None for text-only records), a
train/eval split by pid, and a report of what was skipped and why."""

from __future__ import annotations

from pathlib import Path

from vlmrl.data.prepare import (
    data_summary,
    load_raw_records,
    prepare,
    render_report,
    to_dataset,
)
from vlmrl.errors import run_stage
from vlmrl.outputs import atomic_dir, stage_outputs, stage_parser, write_text_atomic
from vlmrl.params import load_params
from vlmrl.reporting.metrics import write_stage_metrics
from vlmrl.rewards.answer_format import answer_format


def main() -> None:
    """The stage: read data.source, prepare and split the records, and write the train and eval
    datasets, the data report and the metrics together (all or none); prints what was left out
    and where the reasons are."""
    parser = stage_parser(__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory for train/ and eval/")
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args()

    outputs = (args.out / "train", args.out / "eval", args.report, args.metrics,
               args.details)
    params = load_params(args.params)  # a bad param fails here, before any file moves
    with stage_outputs(*outputs):
        settings, system_prompt = params.data, answer_format(params).system_text()
        prepared = prepare(load_raw_records(settings), settings, system_prompt)
        for name, rows in (("train", prepared.train), ("eval", prepared.eval)):
            with atomic_dir(args.out / name) as staging:
                to_dataset(rows).save_to_disk(str(staging))
        write_text_atomic(args.report, render_report(prepared, settings))
        write_stage_metrics("prepare_data", data_summary(prepared), metrics=args.metrics,
                            details=args.details)
    left_out = prepared.filtered_out + len(prepared.skipped)
    where = f": the reasons, with example ids, are in {args.report}" if left_out else ""
    print(f"prepared {len(prepared.train)} train and {len(prepared.eval)} eval records "
          f"({prepared.filtered_out} filtered out, {len(prepared.skipped)} skipped{where})")


if __name__ == "__main__":
    raise SystemExit(run_stage("prepare_data", main))
