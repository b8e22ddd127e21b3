"""prepare_data: MathVista-schema records -> prompts, images, a train/eval split by pid."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmrl.config import load_params, section
from vlmrl.data import (
    DataSettings,
    data_summary,
    load_raw_records,
    prepare,
    render_report,
    to_dataset,
)
from vlmrl.outputs import atomic_dir, remove_outputs, write_json_atomic, write_text_atomic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("data/prepared"))
    parser.add_argument("--report", type=Path, default=Path("data/reports/data_report.md"))
    parser.add_argument("--metrics", type=Path, default=Path("data/metrics/prepare_data.json"))
    args = parser.parse_args()

    settings = DataSettings.from_params(section(load_params(), "data"))
    outputs = (args.out / "train", args.out / "eval", args.report, args.metrics)
    remove_outputs(*outputs)
    prepared = prepare(load_raw_records(settings), settings)
    try:
        for name, rows in (("train", prepared.train), ("eval", prepared.eval)):
            with atomic_dir(args.out / name) as staging:
                to_dataset(rows).save_to_disk(str(staging))
        write_text_atomic(args.report, render_report(prepared, settings))
        write_json_atomic(args.metrics, data_summary(prepared))
    except BaseException:
        remove_outputs(*outputs)
        raise
    print(f"prepared {len(prepared.train)} train and {len(prepared.eval)} eval records "
          f"({len(prepared.skipped)} skipped, {prepared.filtered_out} filtered out)")


if __name__ == "__main__":
    main()
