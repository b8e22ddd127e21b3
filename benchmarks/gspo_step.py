"""Seconds per GSPO optimizer step, generated tokens per second and peak GPU memory, per training
configuration (`gspo_configs.CONFIGS`), on a random-init model with Qwen3-VL-2B's real shapes
(`embedded:qwen3-vl-2b-shape`; `--model embedded:qwen3-vl-8b-shape` for the 8B shape) and the
project's own data (512 px synthetic charts, tables and geometry through prepare_data's own
functions). A random-init model almost never samples EOS (2 ids out of 151,936), so every
completion runs to the maximum length; the mean completion length is recorded to show it.

Each (configuration, length) trains in its own process (`gspo_worker.worker`); results merge
into `--out` as they arrive (`runs`, raw; `results`, configuration -> one entry per completion
length; runs on another model are keyed `config@length@model` and summarized apart), and a run
that would not fit in `--budget-s` is skipped and recorded as such. Each call appends its command
line to `device_calls`, so a results file says how it was made.

Usage (on a GPU machine; tests/gpu/run_on_device.sh bench installs what is missing):
  PYTHONPATH=src python benchmarks/gspo_step.py --configs unsloth_4bit,gpu_profile \\
      --lengths 256 --warmup 2 --steps 4 --out benchmarks/results/gspo_step.json

Tables from stored results, anywhere (nothing measured, no GPU needed; `gspo_tables`):
  python benchmarks/gspo_step.py --from-json RESULTS --doc-block NAME   # one file's full table
  python benchmarks/gspo_step.py --from-json A.json B.json ... --doc-block speed --readme README.md
      # the speed summary: each (model, tokens, configuration) from the first file that has it
  python benchmarks/gspo_step.py --merge CALL1.json CALL2.json ... --out RESULTS
      # several device calls' results in one file (each call records its command line)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from gspo_configs import (
    BASELINE_COMMIT,
    CONFIGS,
    GPU_PROFILE,
    GRAD_ACCUM,
    LORA,
    MODEL,
    NUM_GENERATIONS,
    PER_DEVICE_BATCH,
    RECIPE_2B_PROFILE,
    RECIPE_8B_PROFILE,
    VLLM_SETTINGS,
)
from gspo_measure import (
    bandwidth_fraction,
    copy_bandwidth,
    device_name,
    device_used_bytes,
    versions,
)
from gspo_tables import _fmt, write_doc_table, write_from_json
from gspo_worker import STEP_FIELDS, prepare_train_set, worker

ROOT = Path(__file__).resolve().parents[1]
# What importing this script gives, beside its own functions: the configurations and the
# worker, as the benchmark's face (the recipes' tests hold each recipe to its configuration).
__all__ = ["CONFIGS", "GPU_PROFILE", "MODEL", "RECIPE_2B_PROFILE", "RECIPE_8B_PROFILE",
           "VLLM_SETTINGS", "check_timed_steps", "merge_results", "result_key", "summarize",
           "worker", "worker_env"]


def worker_params_file(knobs: dict[str, Any], baseline_src: Path | None) -> Path:
    """The params.yaml a worker for `knobs` reads (`gspo_worker.library_params` in the worker):
    the baseline's own beside its src/, else the repository's."""
    if knobs.get("library") == "baseline":
        return baseline_src.parent / "params.yaml"
    return ROOT / "params.yaml"


def worker_env(knobs: dict[str, Any], baseline_src: Path | None) -> dict[str, str]:
    """The environment of a worker: the library of BASELINE_COMMIT first on the path for a
    configuration measured on it."""
    env = dict(os.environ)
    if knobs.get("library") != "baseline":
        return env
    if (baseline_src is None or not (baseline_src / "vlmrl").is_dir()
            or not worker_params_file(knobs, baseline_src).is_file()):
        raise SystemExit(f"--baseline-src must be the src/ of {BASELINE_COMMIT} (with vlmrl/ in "
                         f"it), with that commit's params.yaml beside it, not {baseline_src}")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(baseline_src.resolve()),
                                                      env.get("PYTHONPATH")]))
    return env


def check_timed_steps(config: str, knobs: dict[str, Any], steps: int,
                      num_iterations: int = 1) -> None:
    """Refuse a number of timed steps that does not cover whole generation cycles: with one
    generation for several optimizer steps, a window holding none of it (or part of its
    steps) reports tokens/s that are not the configuration's. `num_iterations`: the params'
    `train.grpo.num_iterations` the run trains with (`grpo_num_iterations`)."""
    micro_batches = knobs["steps_per_generation"] * num_iterations
    accumulation = knobs["gradient_accumulation_steps"]
    if steps * accumulation % micro_batches:
        cycle = micro_batches // math.gcd(micro_batches, accumulation)
        raise SystemExit(f"--steps {steps}: {config} generates once every {micro_batches} "
                         f"micro-batches ({accumulation} per optimizer step), so its timed "
                         f"steps must be a multiple of {cycle}")


def grpo_num_iterations(knobs: dict[str, Any], baseline_src: Path | None) -> int:
    """`train.grpo.num_iterations` of the params.yaml a worker for `knobs` reads, read before
    the worker starts."""
    import yaml

    params = yaml.safe_load(worker_params_file(knobs, baseline_src).read_text())
    return int(params["train"]["grpo"].get("num_iterations", 1))


def result_key(config: str, length: int, model: str = MODEL) -> str:
    key = f"{config}@{length}"
    return key if model == MODEL else f"{key}@{model.removeprefix('embedded:')}"


SUMMARY_FIELDS = ("completion_length", "seconds_per_step", "generated_tokens_per_second",
                  "generation_only_tokens_per_second", "peak_allocated_gib", "peak_reserved_gib",
                  "peak_allocated_gib_by_phase", "mean_completion_length", "warmup_steps",
                  "timed_steps", "device", "non_pytorch_gib", "peak_device_gib", "per_step",
                  "decode_steps_per_second", "decode_weight_bytes", "bandwidth_fraction")


def summarize(runs: dict[str, Any], model: str = MODEL) -> dict[str, list[dict[str, Any]]]:
    """configuration -> its measured runs on `model`, one per completion length (failed runs
    left out)."""
    results: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(runs.values(), key=lambda r: (r["config"], r["completion_length"])):
        if run.get("error") or run.get("seconds_per_step") is None:
            continue
        if run.get("model", MODEL) != model:
            continue
        entry = {key: run[key] for key in SUMMARY_FIELDS if key in run}
        entry["settings"] = {key: value for key, value in run.get("settings", {}).items()
                             if key not in ("lora", "generation_kwargs")}
        results.setdefault(run["config"], []).append(entry)
    return results


def this_command() -> str:
    """The command line of this run, as typed from the project root."""
    return " ".join(["python benchmarks/gspo_step.py", *sys.argv[1:]])


def merge_results(files: list[dict[str, Any]], names: list[Path]) -> dict[str, Any]:
    """One results file from several device calls' (`--merge`): every run (a run measured in
    several: the last file's), every call's record (command, device, runs), the settings of the
    last file. Calls on different devices are refused: their figures do not compare."""
    devices = {str(name): results.get("device") for name, results in zip(names, files)}
    if len(set(devices.values())) > 1:
        raise SystemExit(f"--merge: the files were measured on different devices {devices}; "
                         "merge only one device's calls")
    merged: dict[str, Any] = {key: value for key, value in files[-1].items()
                              if key not in ("runs", "device_calls")}
    merged["runs"], merged["device_calls"] = {}, []
    for name, results in zip(names, files):
        merged["runs"].update(results.get("runs", {}))
        calls = results.get("device_calls") or [{"command": None, "source": str(name),
                                                 "runs": sorted(results.get("runs", {}))}]
        merged["device_calls"] += [call for call in calls if call not in merged["device_calls"]]
    return merged


def load_results(path: Path) -> dict[str, Any]:
    if path.is_file():
        return json.loads(path.read_text())
    return {"runs": {}}


def save_results(path: Path, results: dict[str, Any]) -> None:
    results["results"] = summarize(results["runs"])
    others = sorted({run["model"] for run in results["runs"].values()
                     if run.get("model", MODEL) != MODEL})
    results["results_other_models"] = {model: summarize(results["runs"], model)
                                       for model in others}
    results["gpu_profile"] = GPU_PROFILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{'run':44} {'s/step':>7} {'tok/s':>6} {'gen tok/s':>9} {'steps/s':>7} "
          f"{'bound%':>6} {'peak GiB':>8} {'rsv GiB':>7} {'len':>5}  note")
    for key, run in sorted(results["runs"].items()):
        if run.get("error"):
            print(f"{key:44} {run['error'][:100]}")
            continue
        fraction = run.get("bandwidth_fraction")
        print(f"{key:44} {_fmt(run['seconds_per_step'], '7.2f')} "
              f"{_fmt(run['generated_tokens_per_second'], '6.0f')} "
              f"{_fmt(run['generation_only_tokens_per_second'], '9.0f')} "
              f"{_fmt(run.get('decode_steps_per_second'), '7.1f')} "
              f"{_fmt(100 * fraction if fraction else None, '6.1f')} "
              f"{_fmt(run['peak_allocated_gib'], '8.2f')} {_fmt(run['peak_reserved_gib'], '7.2f')} "
              f"{_fmt(run['mean_completion_length'], '5.0f')}"
              f"  {'KV cache dropped' if run.get('kv_cache_dropped_in_generation') else ''}")


def print_steps(key: str, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        print(f"{key} step {row['step']}: " + ", ".join(
            f"{field} {row[field]:.4g}" for field in STEP_FIELDS if field in row), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="unsloth_4bit,gpu_profile,transformers_bf16,"
                                              "transformers_4bit")
    parser.add_argument("--lengths", default="256")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4,
                        help="timed optimizer steps (a multiple of the configurations' steps "
                             "per generation: gpu_profile generates every 2 steps, the rows48 "
                             "ones every 3)")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                        "gspo_step.json")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="skip runs once less than --min-run-s of this budget is left")
    parser.add_argument("--min-run-s", type=float, default=90)
    parser.add_argument("--run-timeout-s", type=float, default=540)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gspo-bench")
    parser.add_argument("--doc", type=Path,
                        help="write the full table of --out (or of --from-json) into this "
                             "Markdown file and exit")
    parser.add_argument("--doc-block", default="roofline",
                        help="which marked block of --doc the table replaces (speed, or "
                             "speed-NAME: the summary of every --from-json file)")
    parser.add_argument("--from-json", type=Path, nargs="+", metavar="RESULTS",
                        help="measure nothing: write the table of these stored results into "
                             "--doc (default docs/benchmarks.md); RESULTS::CONFIG,... takes "
                             "only those configurations' runs of a file (speed block)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="RESULTS",
                        help="measure nothing: combine these results files (one per device "
                             "call, each with the command it ran) into --out; a run measured in "
                             "several takes the last file's")
    parser.add_argument("--readme", type=Path,
                        help="with --doc-block speed: also the summary's sentence into this "
                             "file's speed-readme block")
    parser.add_argument("--baseline-src", type=Path,
                        help="the src/ of commit BASELINE_COMMIT, for the *_before configs: "
                             "git archive BASELINE_COMMIT src params.yaml | tar -x -C DIR "
                             "(then DIR/src)")
    parser.add_argument("--profile-training", action="store_true",
                        help="one more optimizer step after the timed ones, its micro-batches "
                             "under torch.profiler: its kernels by device time in each run's "
                             "training_kernels (not in the timings), and per micro-batch the "
                             "wall seconds against the GPU's busy seconds (training_busy)")
    parser.add_argument("--profile-training-host", action="store_true",
                        help="one more optimizer step after those, its micro-batches under "
                             "cProfile, its generation left out (training_host_profile)")
    parser.add_argument("--profile-host", action="store_true",
                        help="cProfile the host work of the first timed generation's input "
                             "preparation, the generation left out (host_profile; that run's "
                             "timings include the profiler's cost)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--train-set", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--others-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def profile_flags(args: argparse.Namespace) -> list[str]:
    return [*(["--profile-training"] if args.profile_training else []),
            *(["--profile-host"] if args.profile_host else []),
            *(["--profile-training-host"] if args.profile_training_host else [])]


def run_worker(args: argparse.Namespace) -> int:
    """`--worker CONFIG LENGTH`: one run in this process, its result (or why it failed) written
    to `--result`."""
    config, length = args.worker[0], int(args.worker[1])
    try:
        result = worker(config, length, args.warmup, args.steps, args.train_set, args.model,
                        args.seed, partial=args.result.with_suffix(".partial"),
                        others_bytes=args.others_bytes, profile=args.profile_training,
                        profile_host=args.profile_host,
                        profile_training_host=args.profile_training_host)
    except Exception as error:  # noqa: BLE001  (recorded: the table says why a run failed)
        traceback.print_exc()
        result = {"config": config, "completion_length": length,
                  "error": f"{type(error).__name__}: {error}"[:2000]}
    args.result.write_text(json.dumps(result))
    return 0


def checked_configs(args: argparse.Namespace) -> list[str]:
    """The configurations named by --configs, each checked before any setup: known, its
    baseline library given where it needs one, and --steps covering whole generation cycles."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for config in configs:
        if config not in CONFIGS:
            raise SystemExit(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
        worker_env(CONFIGS[config], args.baseline_src)
        check_timed_steps(config, CONFIGS[config], args.steps,
                          grpo_num_iterations(CONFIGS[config], args.baseline_src))
    return [GPU_PROFILE if config == "gpu_profile" else config for config in configs]


def set_up(args: argparse.Namespace) -> Path:
    """Builds the embedded model on the device (once) and the train set; returns the set."""
    from vlmrl.models.embedded import ensure_embedded_model

    os.environ.setdefault("VLMRL_CACHE", str(args.work / "cache"))
    import torch

    model_dir = ensure_embedded_model(args.model, seed=args.seed,
                                      device="cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the build's weights must not sit beside the workers' runs
    train_set = prepare_train_set(args.work, args.dataset_size)
    print(f"model {model_dir}; data {train_set}", flush=True)
    return train_set


def measure(args: argparse.Namespace, config: str, length: int, train_set: Path,
            left: float) -> dict[str, Any]:
    """One run in a worker process of its own, killed past its time; a run without a result
    keeps what its worker left after its last step (`partial`)."""
    key = result_key(config, length, args.model)
    result_file = args.work / f"{key}.json"
    partial = result_file.with_suffix(".partial")
    result_file.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--worker", config, str(length),
               "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--model", args.model, "--seed", str(args.seed),
               "--train-set", str(train_set), "--result", str(result_file),
               "--others-bytes", str(device_used_bytes() or 0), *profile_flags(args)]
    print(f"== {key}", flush=True)
    started = time.perf_counter()
    try:
        subprocess.run(command, timeout=min(args.run_timeout_s, left - 10), check=False,
                       env=worker_env(CONFIGS[config], args.baseline_src))
    except subprocess.TimeoutExpired:
        pass
    if result_file.is_file():
        result = json.loads(result_file.read_text())
    else:
        result = {"config": config, "completion_length": length,
                  "error": f"no result after {time.perf_counter() - started:.0f} s "
                           "(timed out or crashed)"}
        if partial.is_file():
            result["partial"] = json.loads(partial.read_text())
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    if CONFIGS[config].get("library") == "baseline":
        result["library_commit"] = BASELINE_COMMIT
    return result


def run_all(args: argparse.Namespace) -> int:
    """Every (length, configuration) of the call, each in its own worker process, merged into
    --out as it arrives."""
    configs = checked_configs(args)
    started = time.perf_counter()
    train_set = set_up(args)
    results = load_results(args.out)
    results.update(bandwidth_bytes_per_s=copy_bandwidth())
    print(f"copy bandwidth {results['bandwidth_bytes_per_s'] or 0:.4g} B/s", flush=True)
    results.update(device=device_name(), versions=versions(), model=MODEL,
                   num_generations=NUM_GENERATIONS,
                   completions_per_optimizer_step=PER_DEVICE_BATCH * GRAD_ACCUM, lora=LORA)
    call = {"command": this_command(), "device": results["device"],
            "bandwidth_bytes_per_s": results["bandwidth_bytes_per_s"], "runs": []}
    results.setdefault("device_calls", []).append(call)
    for length in [int(x) for x in args.lengths.split(",")]:
        for config in configs:
            left = args.budget_s - (time.perf_counter() - started)
            key = result_key(config, length, args.model)
            if left < args.min_run_s:
                print(f"{key}: skipped, {left:.0f} s of the budget left", flush=True)
                continue
            result = measure(args, config, length, train_set, left)
            result.update(device=results["device"], model=args.model,
                          bandwidth_fraction=bandwidth_fraction(
                              result, results["bandwidth_bytes_per_s"]))
            results["runs"][key] = result
            call["runs"].append(key)
            save_results(args.out, results)
            print(json.dumps({k: v for k, v in result.items()
                              if k not in ("generation_calls", "settings", "per_step")}),
                  flush=True)
            print_steps(key, result.get("per_step", []))
    print_table(results)
    return 0


def main() -> int:
    args = parse_args()
    from vlmrl.distributed.launch import keep_one_gpu, visible_gpus

    # each run trains in one process: on a host with several GPUs, on the first (before torch
    # initialises CUDA; the workers inherit it), as the train_gspo stage does with one process
    keep_one_gpu(visible_gpus(), "benchmarks/gspo_step.py")
    if args.worker:
        return run_worker(args)
    if args.merge:
        save_results(args.out, merge_results([load_results(path) for path in args.merge],
                                             args.merge))
        print(f"{len(args.merge)} results files merged into {args.out}")
        return 0
    if args.from_json:
        write_from_json(args.from_json, args.doc or ROOT / "docs" / "benchmarks.md",
                        args.doc_block, args.readme)
        return 0
    if args.doc:
        write_doc_table(load_results(args.out), args.doc, args.doc_block)
        return 0
    return run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
