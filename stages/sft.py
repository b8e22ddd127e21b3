"""sft_cold_start: prime the answer format with TRL's SFTTrainer before GSPO (vlmrl.sft); writes
the starting LoRA adapter that baseline_eval applies and train_gspo continues."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmrl.errors import run_stage
from vlmrl.metric_files import write_stage_metrics
from vlmrl.outputs import remove_outputs, write_json_atomic
from vlmrl.params import load_params
from vlmrl.sft import run_sft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train-set", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="starting adapter directory")
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True,
                        help="per-step log (a JSON list), rewritten at every logging step")
    parser.add_argument("--details", type=Path, required=True,
                        help="the full summary; the metrics file holds its headline numbers")
    parser.add_argument("--timings", type=Path, required=True,
                        help="wall-clock figures, apart from the metrics later stages depend on")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args()

    outputs = (args.out, args.metrics, args.log, args.details, args.timings)
    remove_outputs(*outputs)
    try:
        summary = run_sft(train_set=args.train_set, params=load_params(args.params), out=args.out,
                          log=args.log)
        write_json_atomic(args.log, summary.pop("log"))
        write_stage_metrics("sft_cold_start", summary, metrics=args.metrics,
                            details=args.details, timings=args.timings)
    except BaseException:
        remove_outputs(*outputs)
        raise
    print(f"SFT: {summary['steps']} steps; starting adapter: {summary['adapter']} ({args.out})")


if __name__ == "__main__":
    raise SystemExit(run_stage("sft_cold_start", main))
