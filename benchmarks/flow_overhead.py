"""What `vlmrl run` costs on a pipeline that is already up to date, against `dvc repro`.

A scheduled run that finds nothing changed is the common one, so its cost is the flow's
overhead. Each command runs as a user runs it, a whole process from a shell in the repo, and is
timed over several runs (the median counts): `dvc repro`, `vlmrl run` without a Prefect server
(DVC says every stage is up to date, so none is started), and `vlmrl run` against a running
Prefect server (PREFECT_API_URL), where the flow itself runs.

    python benchmarks/flow_overhead.py --repo PATH [--runs 5] [--out benchmarks/results/flow_overhead.json]
    python benchmarks/flow_overhead.py --render benchmarks/results/flow_overhead.json --doc docs/prefect.md

The table replaces the block between this script's markers in `--doc` (docs/prefect.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from doc_blocks import render_results, write_doc_block

from vlmrl.pipeline.dvc_env import dvc_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from prefect_server import prefect_env, prefect_server

VLMRL = str(Path(sys.executable).parent / "vlmrl")
COMMANDS = {"dvc repro": [sys.executable, "-m", "dvc", "repro"],
            "vlmrl run, no server": [VLMRL, "run"],
            "vlmrl run, PREFECT_API_URL set": [VLMRL, "run"]}
TARGET_S = 8.0  # `vlmrl run` on an up-to-date pipeline


def timed(command: list[str], repo: Path, env: dict[str, str], runs: int) -> list[float]:
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, cwd=repo, env=env, check=True, capture_output=True, text=True)
        seconds.append(round(time.perf_counter() - started, 2))
    return seconds


def measure(repo: Path, runs: int, home: Path) -> dict:
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=repo, env=dvc_env(),
                            check=True, capture_output=True, text=True).stdout
    if "up to date" not in status:
        raise SystemExit(f"{repo}: reproduce it first (`dvc repro`); dvc status says:\n{status}")
    for folder in ("no-server", "server"):
        (home / folder).mkdir()
    offline = prefect_env(home / "no-server")
    results = {"dvc repro": timed(COMMANDS["dvc repro"], repo, dvc_env(), runs),
               "vlmrl run, no server": timed(COMMANDS["vlmrl run, no server"], repo, offline,
                                             runs)}
    with prefect_server(home / "server") as url:
        with_server = prefect_env(home / "server", url)
        results["vlmrl run, PREFECT_API_URL set"] = timed(
            COMMANDS["vlmrl run, PREFECT_API_URL set"], repo, with_server, runs)
    return {"machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                       f"{platform.python_version()}",
            "runs": runs, "seconds": results}


def table(results: dict) -> str:
    rows = ["| command, on an up-to-date pipeline | median s | min s | max s |",
            "| --- | ---: | ---: | ---: |"]
    for name, seconds in results["seconds"].items():
        rows.append(f"| `{name}` | {statistics.median(seconds):.1f} | {min(seconds):.1f} | "
                    f"{max(seconds):.1f} |")
    slowest = max(statistics.median(seconds) for name, seconds in results["seconds"].items()
                  if name.startswith("vlmrl run"))
    verdict = "met" if slowest <= TARGET_S else "missed"
    note = (f"Median of {results['runs']} runs each on {results['machine']} (target for `vlmrl "
            f"run`, with or without a server: at most {TARGET_S:.0f} s, {verdict}); measured by "
            "`benchmarks/flow_overhead.py`.")
    return "\n".join([*rows, "", note])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, help="an already reproduced project repo")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/flow_overhead.json"))
    parser.add_argument("--render", type=Path, help="a results file: write its table only")
    parser.add_argument("--doc", type=Path, help="write the table into this doc's block")
    args = parser.parse_args()
    if args.render is None:
        if args.repo is None:
            parser.error("--repo is required unless --render is given")
        import tempfile

        with tempfile.TemporaryDirectory(prefix="flow-overhead-") as home:
            results = measure(args.repo.resolve(), args.runs, Path(home))
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        rendered = table(results)
    else:
        rendered = render_results(args.render, table)
    print(rendered)
    if args.doc:
        write_doc_block(args.doc, rendered, Path(__file__).name)


if __name__ == "__main__":
    main()
