"""Does the launched path cost time? The train_gspo stage script runs the GPU profile
(recipes/mathvista-qwen3-vl-2b.yaml's training settings: NF4 weights, static cache, compiled
decoding, micro-batches of 8 x 2 accumulation, generations of 32 rows made 16 at a time) on the
random-init Qwen3-VL-2B-shaped model and the embedded synthetic set, twice in a row in the same
project copy: in its own process (`train.distributed.strategy: none`, one process by default)
and relaunched through `accelerate launch` with one process (`strategy: ddp`,
`num_processes: 1`, vlmrl.distributed.launch).
Seconds per step are the stage's own per-step times (data/reports/timings/train_gspo.json, TRL's
`step_time`) after `--warmup` steps (compilation, cache allocation); the order of the two runs
alternates over `--rounds`.

The stages run as DVC runs them (dvc.yaml's command, in a copy of the project) without DVC itself,
which the GPU machine lacks. SFT is off and nothing is checkpointed inside the timed steps.

Usage (on a GPU machine; tests/gpu/run_on_device.sh launch installs what is missing):
  PYTHONPATH=src python benchmarks/launch_one_process.py --steps 4 --warmup 2 \\
      --out benchmarks/results/launch_one_process.json
  python benchmarks/launch_one_process.py --render benchmarks/results/launch_one_process.json
      # the table between this script's markers in --doc (docs/benchmarks.md); measures nothing
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from doc_blocks import render_results, write_doc_block

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from project_repo import copy_project, stage_command, update_params

from vlmrl.pipeline.recipes import apply_recipe

MODEL = "embedded:qwen3-vl-2b-shape"
RECIPE = ROOT / "recipes" / "mathvista-qwen3-vl-2b.yaml"
VARIANTS = {"in_process": {"train.distributed.strategy": "none"},
            "accelerate_launch_1": {"train.distributed.strategy": "ddp",
                                    "train.distributed.num_processes": 1}}


def project(target: Path, steps: int, length: int) -> Path:
    copy_project(target, source=ROOT)
    apply_recipe(RECIPE, target / "params.yaml", defaults=ROOT / "params.yaml")
    update_params(target, {
        "model.name": MODEL, "data.source": "embedded:synthetic", "data.synthetic_size": 64,
        "data.synthetic_read_size": 0, "data.eval_size": 4, "data.image_size": 512,
        "train.grpo.max_steps": steps, "train.grpo.max_completion_length": length,
        "train.grpo.generation_kwargs": {"max_cache_len": 512 + length, "disable_compile": False},
        "train.grpo.log_completions": False, "train.save_steps": 10**6, "train.resume": False})
    return target


def run_stage(repo: Path, name: str, log: Path) -> float:
    started = time.perf_counter()
    with log.open("a") as handle:
        handle.write(f"\n==== {name}\n")
        handle.flush()
        command = [sys.executable, *stage_command(name, repo)[1:]]  # `python` may be missing
        subprocess.run(command, cwd=repo, stdout=handle,
                       stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - started


def train_once(repo: Path, variant: str, warmup: int, log: Path) -> dict[str, Any]:
    update_params(repo, VARIANTS[variant])
    wall = run_stage(repo, "train_gspo", log)
    timings = json.loads((repo / "data/reports/timings/train_gspo.json").read_text())
    batch = json.loads((repo / "data/reports/details/train_gspo.json").read_text())["batch"]
    timed = timings["step_seconds"][warmup:]
    return {"variant": variant, "seconds_per_step": round(statistics.mean(timed), 3),
            "step_seconds": timings["step_seconds"], "stage_wall_seconds": round(wall, 1),
            "runtime_seconds": timings["runtime_seconds"], "batch": batch}


def table(result: dict[str, Any]) -> str:
    warmup = result["warmup_steps"]
    lines = [(f"{result['device']}, `{result['model']}`, {result['recipe']}'s training settings, "
              f"{result['completion_length']}-token completions, {result['timed_steps']} timed "
              f"steps after {warmup} warm-up steps, {result['rounds']} round(s); a generation "
              "of 32 rows serves two optimizer steps, so timed steps alternate between one "
              "that generates and one that only trains:"),
             "", "| path | timed step seconds (each run) | mean s/step |", "| --- | --- | ---: |"]
    for variant, label in (("in_process", "in process (`strategy: none`)"),
                           ("accelerate_launch_1", "`accelerate launch`, 1 process (`ddp`)")):
        each = "; ".join(", ".join(f"{t:.1f}" for t in r["step_seconds"][warmup:])
                         for r in result["runs"] if r["variant"] == variant)
        lines.append(f"| {label} | {each} | {result['seconds_per_step'][variant]} |")
    lines += ["", f"Launched over in-process: **{result['launched_over_in_process']}x**."]
    return "\n".join(lines)


def render(result_file: Path, doc: Path) -> None:
    write_doc_block(doc, render_results(result_file, table), Path(__file__).name)


def device_name() -> str:
    import torch

    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--length", type=int, default=256, help="max_completion_length")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/launch_one_process.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks.md")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="write the table of an earlier run's JSON into --doc; measure nothing")
    args = parser.parse_args()
    if args.render:
        render(args.render, args.doc)
        return

    from vlmrl.models.embedded import ensure_embedded_model

    ensure_embedded_model(MODEL, device="cuda")  # built once on the GPU, as tests/gpu do
    repo = project(Path(tempfile.mkdtemp(prefix="launch-bench-")) / "repo",
                   args.warmup + args.steps, args.length)
    log = args.out.with_suffix(".stages.log")  # run_on_device.sh tees stdout to <out>.log
    run_stage(repo, "prepare_data", log)
    run_stage(repo, "sft_cold_start", log)  # sft.enabled false: the marker train_gspo reads
    runs = []
    for round_index in range(args.rounds):
        order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            runs.append(train_once(repo, variant, args.warmup, log))
            print(json.dumps(runs[-1]), flush=True)
    per_variant = {variant: statistics.mean(r["seconds_per_step"] for r in runs
                                            if r["variant"] == variant) for variant in VARIANTS}
    result = {"device": device_name(), "model": MODEL, "recipe": RECIPE.name,
              "completion_length": args.length, "warmup_steps": args.warmup,
              "timed_steps": args.steps, "rounds": args.rounds,
              "seconds_per_step": {k: round(v, 3) for k, v in per_variant.items()},
              "launched_over_in_process": round(per_variant["accelerate_launch_1"]
                                                / per_variant["in_process"], 3),
              "params": yaml.safe_load((repo / "params.yaml").read_text())["train"],
              "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("device", "seconds_per_step",
                                             "launched_over_in_process")}))


if __name__ == "__main__":
    main()
