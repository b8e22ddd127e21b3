"""Every measured table of the docs, rewritten by the script that measured it from the results
JSON it stored under benchmarks/results/: nothing runs on a GPU, nothing is measured.

    python benchmarks/doc_tables.py           # rewrite every block of docs/benchmarks.md and
                                              # README.md
    python benchmarks/doc_tables.py --check   # rewrite copies; list the blocks that differ

`--check` (run by tests/test_benchmark_docs.py) fails where a figure was typed into a block by
hand or a results file changed without its table. A new block goes into `TABLES`, with the
command that writes it; a results file no entry reads does not belong under benchmarks/results/
(`unread_results` lists them, and the test fails on one).
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
DOCS = {"{doc}": "docs/benchmarks.md", "{readme}": "README.md", "{prefect}": "docs/prefect.md"}
# The configurations of the speed tables: the Unsloth reference, TRL's generate (NF4, static
# cache, compiled), and the recipe of the file's model shape.
SPEED_2B = "unsloth_4bit,gpu_profile_mb8_spg4_rows16,gpu_profile_graph_fp8_rolled_compiled_images"
SPEED_8B = ("unsloth_4bit,gpu_profile_mb8_spg4_rows16,"
            "gpu_profile_graph_fp8_mb4_rolled_compiled_images")
TRL_PLAIN = ("unsloth_4bit,transformers_bf16,transformers_4bit,gpu_profile_mb8_spg4_rows16,"
             "gpu_profile_bf16")


def results_spec(name: str) -> str:
    """`name` (a results file's stem, or `stem::CONFIG,...`) as gspo_step.py's --from-json
    takes it."""
    stem, marker, configs = name.partition("::")
    return f"{RESULTS}/{stem}.json{marker}{configs}"


def gspo_step_block(block: str, *files: str) -> list[str]:
    return ["gspo_step.py", "--from-json", *(results_spec(name) for name in files),
            "--doc-block", block, "--doc", "{doc}"]


# Each entry: a script in benchmarks/ and its arguments; "{doc}" and "{readme}" stand for the
# files in DOCS (or their copies under --check).
TABLES: tuple[list[str], ...] = (
    [*gspo_step_block("speed", f"gspo_step_h200x2_pool_2b::{SPEED_2B}",
                      f"gspo_step_h200x2_8b_four::{SPEED_8B}"), "--readme", "{readme}"],
    gspo_step_block("speed-trl", f"gspo_step::{TRL_PLAIN}"),
    ["pipeline.py", "--render", f"{RESULTS}/pipeline.json", "--doc", "{doc}"],
    ["learning.py", "--summary", f"{RESULTS}/learning.json", f"{RESULTS}/learning_gpu_bf16.json",
     f"{RESULTS}/learning_gpu_nf4.json", f"{RESULTS}/learning_gpu_unsloth.json", "--doc", "{doc}"],
    ["learning.py", "--from-json", f"{RESULTS}/learning.json", "--doc", "{doc}",
     "--readme", "{readme}"],
    ["scaling.py", "--render", f"{RESULTS}/scaling.json", "--out", f"{RESULTS}/scaling.json",
     "--doc", "{doc}"],
    ["launch_one_process.py", "--render", f"{RESULTS}/launch_one_process.json", "--doc", "{doc}"],
    ["flow_overhead.py", "--render", f"{RESULTS}/flow_overhead.json", "--doc", "{prefect}"],
    gspo_step_block("h200x2-pool-2b", "gspo_step_h200x2_pool_2b"),
    gspo_step_block("h200x2-8b-four", "gspo_step_h200x2_8b_four"),
    ["decode_profile.py", "--from-json", f"{RESULTS}/decode_profile_h200_parts_bfloat16_2b.json",
     f"{RESULTS}/decode_profile_h200_8b.json", "--doc", "{doc}"],
    ["cpu_kernels.py", "--from-json", f"{RESULTS}/cpu_kernels.json", "--doc", "{doc}"],
)


def unread_results() -> list[str]:
    """The files under benchmarks/results/ that no entry of `TABLES` reads."""
    read = {arg.split("::")[0].removeprefix(f"{RESULTS}/") for entry in TABLES for arg in entry}
    return sorted(path.name for path in (ROOT / RESULTS).glob("*.json") if path.name not in read)


def command(entry: list[str], docs: dict[str, Path]) -> list[str]:
    """The entry's command line, its doc placeholders filled with `docs`' paths."""
    script, *args = entry
    return [sys.executable, str(ROOT / "benchmarks" / script),
            *(str(docs[arg]) if arg in docs else arg for arg in args)]


def rewrite(docs: dict[str, Path]) -> None:
    """Runs every entry of `TABLES` against `docs`; stops at the first that fails, naming it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for entry in TABLES:
        result = subprocess.run(command(entry, docs), cwd=ROOT, env=env, text=True,
                                capture_output=True, check=False)
        if result.returncode != 0:
            raise SystemExit(f"benchmarks/{' '.join(entry)} failed: "
                             f"{(result.stderr or result.stdout).strip().splitlines()[-1:]}")


def check() -> list[str]:
    """The diff of each doc against its rewritten copy (empty where every block is as its
    script writes it)."""
    with tempfile.TemporaryDirectory(prefix="doc-tables-") as tmp:
        copies = {key: Path(tmp) / Path(path).name for key, path in DOCS.items()}
        for key, path in DOCS.items():
            shutil.copyfile(ROOT / path, copies[key])
        rewrite(copies)
        diffs = []
        for key, path in DOCS.items():
            diffs += difflib.unified_diff(
                (ROOT / path).read_text(encoding="utf-8").splitlines(),
                copies[key].read_text(encoding="utf-8").splitlines(),
                f"{path} (as committed)", f"{path} (as the scripts write it)", lineterm="")
        return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing: show where the docs differ from what the scripts "
                             "write and the results no table reads, exit 1 if there are any")
    args = parser.parse_args()
    if args.check:
        diffs, unread = check(), unread_results()
        print("\n".join(diffs) or "every table is as its script writes it")
        if unread:
            print(f"results no table reads (git history keeps them): {', '.join(unread)}")
        return 1 if diffs or unread else 0
    rewrite({key: ROOT / path for key, path in DOCS.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
