"""DVC stage verify_lora: fail the pipeline on an adapter that is untrained, mis-configured or
adapts the vision tower, before it is merged, exported and published.

Thin on purpose: the checks are in vlmrl.verification.lora. The metrics file is written only when
every check passes; on a failure the findings are printed and the stage exits 1, leaving the
earlier metrics as they were.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlmrl.errors import run_stage
from vlmrl.outputs import stage_outputs, stage_parser
from vlmrl.params import load_params
from vlmrl.reporting.metrics import write_stage_metrics
from vlmrl.verification.lora import report_summary, verify_adapter


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The stage's paths (from `sys.argv` where `argv` is None): the adapter and the eval set
    whose first item the logits are compared on, and `stage_parser`'s own."""
    parser = stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--eval-set", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The stage: every check of the adapter; the metrics are written only when all pass, else
    the findings are printed and the stage exits 1. Returns the exit status."""
    args = parse_args(argv)
    params = load_params(args.params)  # a bad param fails here, before any file moves
    with stage_outputs(args.metrics, args.details):
        report = verify_adapter(params.model, args.adapter, args.eval_set, params.train.lora,
                                params.verify.logit_tolerance)
        print(report_summary(report))
        if not report.passed:
            print(report.failure_message(), file=sys.stderr)
            raise SystemExit(1)  # the earlier metrics come back
        write_stage_metrics("verify_lora", report.to_json(), metrics=args.metrics,
                            details=args.details)
    print(f"adapter {args.adapter} passed all {len(report.checks)} checks; "
          f"metrics in {args.metrics}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_stage("verify_lora", main))
