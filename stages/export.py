"""DVC stage export: merge the adapter into the 16-bit base model, convert it to GGUF (f16, q8_0,
Q4_K_M and the vision projector) and check every artifact against the one before it. (The model
card is the upload stage's, so that an eval rerun never reruns the export.)

Thin on purpose: the work is in vlmrl.export.exporter and vlmrl.export.gguf. The merged model, the
GGUF files and the metrics appear only when every check passed; a failed export leaves the
earlier ones as they were (vlmrl.outputs.stage_outputs).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmrl.errors import run_stage
from vlmrl.export.exporter import run_export
from vlmrl.outputs import stage_outputs, stage_parser
from vlmrl.params import load_params
from vlmrl.reporting.metrics import write_stage_metrics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The stage's paths (from `sys.argv` where `argv` is None): the adapter and eval set it
    reads, the merged model and GGUF folders it writes, and `stage_parser`'s own."""
    parser = stage_parser(__doc__.splitlines()[0], timings=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--eval-set", type=Path, required=True)
    parser.add_argument("--merged", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The stage: merge, convert and check (`run_export`), the outputs appearing only when every
    check passed; prints one summary line. Returns the exit status."""
    args = parse_args(argv)
    outputs = (args.merged, args.gguf, args.metrics, args.details, args.timings)
    params = load_params(args.params)  # a bad param fails here, before any file moves
    with stage_outputs(*outputs):
        metrics = run_export(params=params, adapter=args.adapter,
                             eval_set=args.eval_set, merged_out=args.merged, gguf_out=args.gguf)
        write_stage_metrics("export", metrics, metrics=args.metrics, details=args.details,
                            timings=args.timings)
    diffs = ", ".join(f"{name} {value:.3g}" for name, value in
                      metrics["logit_max_abs_diff"].items())
    print(f"exported {args.merged} and {len(list(args.gguf.glob('*.gguf')))} GGUF files in "
          f"{args.gguf} ({metrics['timings_s']['total']:.0f} s); max |logit diff|: {diffs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_stage("export", main))
