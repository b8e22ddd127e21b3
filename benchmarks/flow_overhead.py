"""Time what the Prefect flow adds on top of DVC when nothing is stale.

A cached pipeline is the common scheduled run (nothing changed overnight), so its cost is the
flow's overhead: one `dvc repro --single-item` process per stage instead of one `dvc repro`, plus
Prefect's task bookkeeping. Prints seconds for each, on an already reproduced project repo.

Usage: python benchmarks/flow_overhead.py --repo PATH [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from vlmrl.pipeline.dvc_env import dvc_env
from vlmrl.pipeline.orchestration import load_pipeline_flow, repro_command


def seconds(action: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.monotonic()
        action()
        times.append(time.monotonic() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True, help="an already reproduced repo")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    repo = args.repo.resolve()

    from prefect.testing.utilities import prefect_test_harness

    pipeline = load_pipeline_flow(repo)
    stages = [stage.name for stage in sys.modules[pipeline.fn.__module__].PIPELINE]

    def dvc(cmd: list[str]) -> None:
        subprocess.run(cmd, cwd=repo, env=dvc_env(), check=True, capture_output=True)

    def flow() -> None:
        report = pipeline(repo=str(repo))
        assert not any(stage.ran for stage in report.stages), "the repo was not reproduced"

    one_repro = seconds(lambda: dvc([sys.executable, "-m", "dvc", "repro"]), args.repeat)
    per_stage = seconds(lambda: [dvc(repro_command(stage)) for stage in stages], args.repeat)
    with prefect_test_harness(server_startup_timeout=120):
        flow_run = seconds(flow, args.repeat)
    print(f"cached pipeline, median of {args.repeat}:")
    print(f"  dvc repro (one process)             {one_repro:6.1f} s")
    print(f"  dvc repro -s, one per stage ({len(stages)})     {per_stage:6.1f} s")
    print(f"  Prefect flow (harness server)       {flow_run:6.1f} s")


if __name__ == "__main__":
    main()
