"""Time `vlmrl.evaluation.evaluate.run_evaluation` on the params.yaml defaults (the embedded tiny Qwen3-VL).

Evaluation runs twice per pipeline (baseline and post) and generation dominates it, so this
prints generated samples/s and tokens/s (generation only, as the metrics define them) next to
the wall time of the whole call (loading and scoring included). Without a prepared eval set it
prepares one in a temporary directory.

Usage (from the repository root):
    .venv/bin/python benchmarks/eval_throughput.py [--eval-set DIR] [--repeat N] [--batch-size B]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vlmrl.evaluation.evaluate import run_evaluation
from vlmrl.params import EvalParams, load_params

ROOT = Path(__file__).resolve().parents[1]


def eval_set_or_prepare(eval_set: Path, params: Path) -> Path:
    """The given eval set, or one prepared from `params` into a temporary directory (never into
    the repository, where DVC owns data/prepared)."""
    if eval_set.exists():
        return eval_set
    prepared = Path(tempfile.mkdtemp(prefix="vlmrl-bench-")) / "prepared"
    print(f"{eval_set} is missing; preparing one in {prepared}")
    subprocess.run([sys.executable, str(ROOT / "stages" / "prepare_data.py"), "--out", str(prepared),
                    "--report", str(prepared / "data_report.md"),
                    "--metrics", str(prepared / "prepare_data.json")],
                   cwd=params.resolve().parent, check=True)
    return prepared / "eval"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-set", type=Path, default=ROOT / "data" / "prepared" / "eval")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--batch-size", type=int, help="overrides params.yaml eval.batch_size")
    args = parser.parse_args()

    params = load_params(args.params)
    eval_params = params.eval
    if args.batch_size:
        eval_params = EvalParams.from_params({**params.section("eval"),
                                              "batch_size": args.batch_size})
    eval_set = eval_set_or_prepare(args.eval_set, args.params)
    print(f"model {params.model.name}, eval {eval_params}")
    for attempt in range(1, args.repeat + 1):
        start = time.perf_counter()
        _records, metrics = run_evaluation(eval_set, params.model, eval_params, params.rewards)
        wall = time.perf_counter() - start
        print(f"run {attempt}: {metrics['n']} samples, {metrics['generated_tokens']} tokens in "
              f"{metrics['seconds']:.2f} s of generation ({wall:.2f} s wall): "
              f"{metrics['samples_per_second']:.2f} samples/s, "
              f"{metrics['generated_tokens_per_second']:.1f} generated tokens/s")


if __name__ == "__main__":
    main()
