"""DVC stage verify_lora: fail the pipeline on an adapter that is untrained, mis-configured or
adapts the vision tower, before it is merged, exported and published.

Thin on purpose: the checks are in vlmrl.verify. The metrics file is written only when every
check passes; on a failure the findings are printed and the stage exits 1 with no output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlmrl.config import ParamsError, load_params, section
from vlmrl.modeling import ModelSettings
from vlmrl.outputs import remove_outputs, write_json_atomic
from vlmrl.verify import (
    logit_tolerance_from_params,
    lora_spec_from_params,
    report_summary,
    verify_adapter,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", type=Path, default=Path("data/models/adapter"))
    parser.add_argument("--eval-set", type=Path, default=Path("data/prepared/eval"))
    parser.add_argument("--metrics", type=Path, default=Path("data/metrics/verify_lora.json"))
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    remove_outputs(args.metrics)
    try:
        params = load_params(args.params)
        settings = ModelSettings.from_params(section(params, "model"))
        spec = lora_spec_from_params(params)
        tolerance = logit_tolerance_from_params(params)
        report = verify_adapter(settings, args.adapter, args.eval_set, spec, tolerance)
    except (ParamsError, FileNotFoundError) as error:
        print(f"verify_lora failed: {error}", file=sys.stderr)
        return 1
    print(report_summary(report))
    if not report.passed:
        print(report.failure_message(), file=sys.stderr)
        return 1
    write_json_atomic(args.metrics, report.to_json())
    print(f"adapter {args.adapter} passed all {len(report.checks)} checks; "
          f"metrics in {args.metrics}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
