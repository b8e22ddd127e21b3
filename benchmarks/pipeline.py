"""The pipeline's own overhead on the embedded default: a first full `dvc repro` split by stage,
a no-op `dvc repro`, a rerun after one train param changed, and the Prefect flow over an
all-cached pipeline. Runs on a fresh git + DVC copy of the project.

    python benchmarks/pipeline.py [--out benchmarks/results/pipeline.json]
    python benchmarks/pipeline.py --render benchmarks/results/pipeline.json   # table only

The table replaces the block between this script's markers in `--doc` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from doc_blocks import render_results, write_doc_block

from vlmrl.pipeline.dvc_env import dvc_env

# The tests' copy of the project (tests/project_repo.py), so the benchmark times the repo they use.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from project_repo import make_project_repo, update_params

STAGE_LINE = re.compile(r"Running stage '([^']+)'")
SKIP_LINE = re.compile(r"Stage '([^']+)' didn't change, skipping")
TARGETS = {"full_run_s": 300.0, "noop_s": 3.0, "cached_flow_s": 15.0}


def timed_repro(repo: Path, *args: str) -> dict:
    """Runs `dvc repro`, timing each stage from its 'Running stage' line to the next."""
    started = time.perf_counter()
    process = subprocess.Popen(["dvc", "repro", *args], cwd=repo, env=dvc_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stage_starts: list[tuple[str, float]] = []
    skipped: list[str] = []
    for line in process.stdout:
        now = time.perf_counter() - started
        if match := STAGE_LINE.search(line):
            stage_starts.append((match.group(1), now))
        elif match := SKIP_LINE.search(line):
            skipped.append(match.group(1))
    if process.wait() != 0:
        raise RuntimeError(f"dvc repro {' '.join(args)} failed in {repo}")
    total = time.perf_counter() - started
    ends = [start for _, start in stage_starts[1:]] + [total]
    stages = {name: round(end - start, 2) for (name, start), end in zip(stage_starts, ends)}
    return {"seconds": round(total, 2), "ran": list(stages), "stage_seconds": stages,
            "skipped": skipped}


def timed_cached_flow(repo: Path) -> dict:
    """The Prefect flow over an all-cached pipeline, timed after the test server is up."""
    from prefect.testing.utilities import prefect_test_harness

    from vlmrl.pipeline.orchestration import load_pipeline_flow

    pipeline = load_pipeline_flow(repo)
    with prefect_test_harness(server_startup_timeout=120):
        started = time.perf_counter()
        report = pipeline(repo=str(repo))
        seconds = time.perf_counter() - started
    ran = [stage.stage for stage in report.stages if stage.ran]
    return {"seconds": round(seconds, 2), "stages_that_ran": ran}


def held_out_figures(repo: Path) -> dict:
    """Format compliance and mean reward before and after GSPO: the same run's learning figures
    (benchmarks/learning.py measures them over seeds)."""
    metrics = {name: json.loads((repo / "data/metrics" / f"{name}.json").read_text())
               for name in ("baseline_eval", "post_eval")}
    return {f"{name}_{key}": metrics[name][key] for name in metrics
            for key in ("format_compliance", "mean_reward")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline.json"))
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="write the table of an earlier run's JSON into --doc; measure nothing")
    args = parser.parse_args()
    if args.render:
        write_doc_block(args.doc, render_results(args.render, render_table), Path(__file__).name)
        return
    with tempfile.TemporaryDirectory(prefix="vlmrl-bench-") as tmp:
        repo = make_project_repo(Path(tmp) / "repo")
        first = timed_repro(repo)
        first["held_out"] = held_out_figures(repo)
        noop = timed_repro(repo)
        update_params(repo, {"train.grpo.learning_rate": 1.0e-4})
        rerun = timed_repro(repo)
        flow = timed_cached_flow(repo)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "first_full_repro": first, "noop_repro": noop, "rerun_after_train_param": rerun,
        "cached_flow": flow, "targets": TARGETS,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    table = render_table(results)
    write_doc_block(args.doc, table, Path(__file__).name)
    print(table)


def render_table(results: dict) -> str:
    first = results["first_full_repro"]
    lines = [f"Machine: {results['machine']}.", "",
             "| measurement | seconds | target |", "| --- | ---: | ---: |",
             f"| first full `dvc repro` | {first['seconds']} | < {TARGETS['full_run_s']:.0f} |"]
    lines += [f"| - {stage} | {seconds} | |" for stage, seconds in first["stage_seconds"].items()]
    lines.append(f"| no-op `dvc repro` | {results['noop_repro']['seconds']} "
                 f"| < {TARGETS['noop_s']:.0f} |")
    rerun = results["rerun_after_train_param"]
    lines.append(f"| rerun after `train.grpo.learning_rate` changed ({', '.join(rerun['ran'])}) "
                 f"| {rerun['seconds']} | |")
    flow = results["cached_flow"]
    lines.append(f"| Prefect flow, all cached (test server already up) | {flow['seconds']} "
                 f"| < {TARGETS['cached_flow_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
