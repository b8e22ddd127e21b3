"""Does the default pipeline learn? The product's central claim, measured the way a user
would see it: for each seed, a fresh git + DVC copy of the project runs `dvc repro post_eval`
(prepare_data, sft_cold_start, baseline_eval, train_gspo, post_eval) and the held-out figures of
baseline_eval and post_eval are compared.

A seed sets every source of randomness of a run: the synthetic set and its train/eval split
(`data.seed`), the cold-start SFT (`sft.args.seed`) and GSPO's sampling (`train.grpo.seed`). The
base model's weights (`model.seed`) stay fixed: it is the model being taught, not run noise.

The claim (`Claim`) holds when, on every seed, format compliance and mean reward rise, and the
mean format gain is at least 15 points and at least 3 standard errors of the mean. The JSON goes to
`--out`; the table replaces the block between this script's markers in `--doc`
(docs/benchmarks.md), so the figures there are never typed by hand.

    python benchmarks/learning.py --seeds 0 1 2 3 4 5 6 7 8 9   # the CPU default
    python benchmarks/learning.py --seeds 42 --set model.load_in_4bit=true ...   # e.g. a GPU run
    python benchmarks/learning.py --from-json RESULTS --doc-block :gpu-bf16   # a stored run's table
    python benchmarks/learning.py --summary CPU.json GPU1.json ...   # seeds x runs, block :summary

`--without-dvc` runs the same stage commands (dvc.yaml's `cmd`, paths filled in) one after the
other in a plain copy, for a GPU machine where DVC is not installed (tests/gpu/run_on_device.sh
learning ...). `--jobs N` runs N seeds at once: on a GPU machine with many cores they share
the GPU (the seconds column is then the wall time of runs sharing it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from doc_blocks import render_results
from doc_blocks import write_doc_block as write_block

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from project_repo import copy_project, make_project_repo, run, stage_command

SEEDS = tuple(range(10))  # not the seeds the defaults were tuned on (42, 7, 13)
STAGES = ("prepare_data", "sft_cold_start", "baseline_eval", "train_gspo", "post_eval")
SEED_KEYS = ("data.seed", "sft.args.seed", "train.grpo.seed")
HEADLINE = ("format_compliance", "accuracy", "mean_reward")


def parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {text!r}: expected KEY=VALUE, e.g. train.grpo.max_steps=4")
    return key, yaml.safe_load(value)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def train_mechanics(log_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-step facts every run must show: gradients always flow, GSPO's clip acts on
    off-policy steps without zeroing them, and most groups have a reward spread."""
    grad_norms = [row["grad_norm"] for row in log_rows if "grad_norm" in row]
    off_policy_clip = [row["clip_ratio_region_mean"] for row in log_rows
                       if "clip_ratio_region_mean" in row and "reward" not in row]
    zero_std = [row["frac_reward_zero_std"] for row in log_rows if "frac_reward_zero_std" in row]
    return {"min_grad_norm": min(grad_norms), "off_policy_clip_min": min(off_policy_clip),
            "off_policy_clip_max": max(off_policy_clip),
            "mean_frac_reward_zero_std": statistics.fmean(zero_std)}


def run_without_dvc(repo: Path, stages: tuple[str, ...] = STAGES,
                    threads: int | None = None) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(repo / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    for name in stages:
        print(f"{repo.name}: running {name}", flush=True)
        argv = stage_command(name, repo)
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        result = subprocess.run(argv, cwd=repo, env=env, text=True, capture_output=True,
                                check=False)
        if result.returncode != 0:
            raise SystemExit(f"stage {name} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")


def run_seed(seed: int, overrides: dict[str, Any], workdir: Path,
             without_dvc: bool = False, threads: int | None = None) -> dict[str, Any]:
    update = {**dict.fromkeys(SEED_KEYS, seed), **overrides}
    started = time.perf_counter()
    if without_dvc:
        repo = copy_project(workdir / f"seed-{seed}", update)
        run_without_dvc(repo, threads=threads)
    else:
        repo = make_project_repo(workdir / f"seed-{seed}", update)
        run(["dvc", "repro", "post_eval"], repo)
    seconds = time.perf_counter() - started
    metrics = repo / "data" / "metrics"
    baseline, post = read_json(metrics / "baseline_eval.json"), read_json(metrics / "post_eval.json")
    log_rows = read_json(metrics / "train_log.json")
    result: dict[str, Any] = {"seed": seed, "seconds": round(seconds, 1),
                              "mechanics": train_mechanics(log_rows)}
    for key in HEADLINE:
        result[key] = {"baseline": baseline[key], "post": post[key],
                       "delta": post[key] - baseline[key]}
    tiers = sorted(set(baseline["accuracy_by_tier"]) | set(post["accuracy_by_tier"]))
    result["accuracy_by_tier"] = {tier: {"baseline": baseline["accuracy_by_tier"].get(tier),
                                         "post": post["accuracy_by_tier"].get(tier)}
                                  for tier in tiers}
    result["n_eval"] = post["n"]
    return result


def run_seed_or_failure(seed: int, overrides: dict[str, Any], workdir: Path,
                        without_dvc: bool = False, threads: int | None = None) -> dict[str, Any]:
    """`run_seed`, or {"seed", "error"} where a stage failed: the other seeds still finish."""
    try:
        return run_seed(seed, overrides, workdir, without_dvc, threads)
    except (SystemExit, AssertionError) as error:
        return {"seed": seed, "error": str(error)[-6000:]}


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


@dataclasses.dataclass(frozen=True)
class Claim:
    """What "it learns" means: on every seed format compliance and mean reward rise
    by more than `min_format_gain` / 0, and the mean format gain is at least `min_mean_gain` and
    at least `min_standard_errors` standard errors of the mean (std / sqrt(seeds))."""
    min_format_gain: float = 0.0
    min_mean_gain: float = 0.15
    min_standard_errors: float = 3.0


def summarize(runs: list[dict[str, Any]], claim: Claim = Claim()) -> dict[str, Any]:
    summary = {key: {part: spread([r[key][part] for r in runs])
                     for part in ("baseline", "post", "delta")} for key in HEADLINE}
    format_delta = summary["format_compliance"]["delta"]
    standard_error = format_delta["std"] / math.sqrt(len(runs))
    summary["claim"] = {
        "every_seed_format_gain": all(r["format_compliance"]["delta"] > claim.min_format_gain
                                      for r in runs),
        "every_seed_reward_gain": all(r["mean_reward"]["delta"] > 0 for r in runs),
        "mean_gain_large_enough": format_delta["mean"] >= claim.min_mean_gain,
        "mean_gain_beats_its_standard_error": (
            format_delta["mean"] >= claim.min_standard_errors * standard_error),
    }
    summary["claim"]["holds"] = all(summary["claim"].values())
    summary["claim"].update(dataclasses.asdict(claim), standard_error=standard_error)
    return summary


def _points(value: float) -> str:
    return f"{100 * value:+.1f}"


def machine_text(results: dict[str, Any]) -> str:
    text = results["machine"]
    if results.get("device", "CPU") != "CPU":
        text += f", {results['device']}"
    if results.get("jobs", 1) > 1:
        text += f", {results['jobs']} seeds at once"
    return text


def render_table(results: dict[str, Any]) -> str:
    runs, summary = results["runs"], results["summary"]
    lines = [
        (f"Measured {results['date']} on {machine_text(results)}; "
         f"{runs[0]['n_eval']} held-out eval items per seed; overrides: "
         f"{results['overrides'] or 'none (the defaults)'}."),
        "",
        ("| seed | format compliance (baseline → post) | accuracy | mean reward "
         "| read-tier accuracy | min grad norm | off-policy clip ratio | groups with reward std 0 "
         "| seconds |"),
        "| --- | --- | --- | --- | --- | ---: | --- | ---: | ---: |",
    ]
    for r in runs:
        read = r["accuracy_by_tier"].get("read", {})
        read_text = (f"{read['baseline']:.2f} → {read['post']:.2f}"
                     if read.get("baseline") is not None and read.get("post") is not None else "–")
        m = r["mechanics"]
        lines.append(
            f"| {r['seed']} "
            + "".join(f"| {r[k]['baseline']:.3f} → {r[k]['post']:.3f} ({_points(r[k]['delta'])}) "
                      if k != "mean_reward" else
                      f"| {r[k]['baseline']:.3f} → {r[k]['post']:.3f} ({r[k]['delta']:+.3f}) "
                      for k in HEADLINE)
            + f"| {read_text} | {m['min_grad_norm']:.3f} "
            f"| {m['off_policy_clip_min']:.2f}–{m['off_policy_clip_max']:.2f} "
            f"| {100 * m['mean_frac_reward_zero_std']:.0f}% | {r['seconds']:.0f} |")
    lines += ["", "| metric | baseline mean ± std | post mean ± std | delta mean ± std |",
              "| --- | --- | --- | --- |"]
    for key in HEADLINE:
        cells = [f"{summary[key][part]['mean']:.3f} ± {summary[key][part]['std']:.3f}"
                 for part in ("baseline", "post", "delta")]
        lines.append(f"| {key.replace('_', ' ')} | " + " | ".join(cells) + " |")
    claim = summary["claim"]
    lines += ["", (f"Claim (every seed: format compliance up by more than "
                   f"{100 * claim['min_format_gain']:.0f} points and mean reward up; mean format "
                   f"gain ≥ {100 * claim['min_mean_gain']:.0f} points and ≥ "
                   f"{claim['min_standard_errors']:g} standard errors, here "
                   f"{100 * claim['standard_error']:.1f} points): "
                   f"**{'holds' if claim['holds'] else 'does not hold'}** "
                   f"(format gain on every seed: {claim['every_seed_format_gain']}, reward gain "
                   f"on every seed: {claim['every_seed_reward_gain']}, mean gain large enough: "
                   f"{claim['mean_gain_large_enough']}, mean gain beats its standard error: "
                   f"{claim['mean_gain_beats_its_standard_error']}).")]
    return "\n".join(lines)


def device_name() -> str:
    """The GPU the stages ran on, or "CPU" (the stages choose CUDA when it is there)."""
    try:
        import torch
    except ImportError:
        return "CPU"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def range_line(results: dict[str, Any]) -> str:
    """What a newcomer should expect, as the range over the seeds measured (for README.md)."""
    runs = results["runs"]
    gains = {key: [r[key]["delta"] for r in runs] for key in HEADLINE}
    fmt, reward = gains["format_compliance"], gains["mean_reward"]
    mean = statistics.fmean(fmt)
    return (f"format compliance rose on {sum(g > 0 for g in fmt)} of {len(runs)} seeds, by "
            f"{100 * min(fmt):+.1f} to {100 * max(fmt):+.1f} points (mean {100 * mean:+.1f}), "
            f"and mean reward on {sum(g > 0 for g in reward)} of {len(runs)}, by "
            f"{min(reward):+.2f} to {max(reward):+.2f}; accuracy moved by "
            f"{100 * statistics.fmean(gains['accuracy']):+.1f} points on average. Measured "
            f"{results['date']} by `benchmarks/learning.py`.")


def write_doc_block(doc: Path, table: str, suffix: str) -> None:
    """The table between this script's markers with `suffix` (":gpu-bf16", ":readme") in `doc`."""
    write_block(doc, table, Path(__file__).name, suffix)


def run_label(results: dict[str, Any]) -> str:
    """A column title for one results file: where it ran and what it overrode."""
    device = results["device"].removeprefix("NVIDIA ")
    overrides = results["overrides"]
    if not overrides:
        return f"{device}, the defaults"
    return device + ", " + ", ".join(
        f"`{key}={str(value).lower() if isinstance(value, bool) else value}`"
        for key, value in overrides.items())


def gain_cell(run: dict[str, Any]) -> str:
    return (f"{_points(run['format_compliance']['delta'])} / "
            f"{run['mean_reward']['delta']:+.3f}")


def summary_column(results: dict[str, Any]) -> dict[str, Any]:
    """One results file as a column of the summary table: its cell per seed, the mean row and
    the claim's verdict."""
    if results["summary"] is None:
        raise KeyError("summary")  # a run with a failed seed stores none: nothing to summarise
    summary, claim = results["summary"], results["summary"]["claim"]
    fmt, reward = summary["format_compliance"]["delta"], summary["mean_reward"]["delta"]
    return {"label": run_label(results), "date": results["date"],
            "seeds": {run["seed"]: gain_cell(run) for run in results["runs"]},
            "mean": (f"{_points(fmt['mean'])} ± {100 * fmt['std']:.1f} / "
                     f"{reward['mean']:+.3f} ± {reward['std']:.3f}"),
            "claim": (f"**{'holds' if claim['holds'] else 'does not hold'}** (standard error "
                      f"{100 * claim['standard_error']:.1f} points)"),
            "seconds": seconds_cell([run["seconds"] for run in results["runs"]])}


def seconds_cell(seconds: list[float]) -> str:
    """A column's wall seconds per seed run: the median and the range."""
    return f"{statistics.median(seconds):.0f} ({min(seconds):.0f}–{max(seconds):.0f})"


def summary_table(files: list[Path]) -> str:
    """Seeds down, runs across (the CPU default and each GPU backend): each seed's format
    compliance gain in points and mean reward gain, the mean over seeds and the claim's verdict,
    from the results files this script wrote."""
    columns = [render_results(path, summary_column) for path in files]
    seeds = sorted({seed for column in columns for seed in column["seeds"]})
    header = "| seed | " + " | ".join(column["label"] for column in columns) + " |"
    lines = [("Each cell: format compliance gain in points / mean reward gain, baseline → post "
              "on the held-out items (`benchmarks/learning.py --summary`; a run's every figure "
              "per seed: `--from-json`). Seconds: the wall time of one seed's run, prepare_data "
              "to post_eval, median (range). Measured "
              + ", ".join(sorted({column["date"] for column in columns})) + "; GPU runs: "
              "the seeds of one column ran at once on one GPU."), "", header,
             "| --- |" + " --- |" * len(columns)]
    for seed in seeds:
        lines.append(f"| {seed} | " + " | ".join(column["seeds"].get(seed, "not run")
                                                  for column in columns) + " |")
    lines.append("| mean ± std | " + " | ".join(column["mean"] for column in columns) + " |")
    lines.append("| claim | " + " | ".join(column["claim"] for column in columns) + " |")
    lines.append("| seconds | " + " | ".join(column["seconds"] for column in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="a params override (YAML value), repeatable")
    parser.add_argument("--min-format-gain", type=float, default=Claim.min_format_gain,
                        help="every seed's format gain must exceed it")
    parser.add_argument("--min-mean-gain", type=float, default=Claim.min_mean_gain)
    parser.add_argument("--min-standard-errors", type=float, default=Claim.min_standard_errors)
    parser.add_argument("--jobs", type=int, default=1,
                        help="seeds run at once (each its own processes; on one GPU they share it)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/learning.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks.md")
    parser.add_argument("--doc-block", default="",
                        help="marker suffix of the table's block in --doc (e.g. ':gpu')")
    parser.add_argument("--no-doc", action="store_true", help="write the JSON only")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also write the range over the seeds into this file's block "
                             "(README.md, marker suffix ':readme')")
    parser.add_argument("--without-dvc", action="store_true",
                        help="run the stage commands directly (a machine without DVC)")
    parser.add_argument("--from-json", type=Path, metavar="RESULTS",
                        help="run nothing: write the table of a results file this script wrote "
                             "(e.g. on a GPU machine) into --doc")
    parser.add_argument("--summary", type=Path, nargs="+", metavar="RESULTS",
                        help="run nothing: write the seeds x runs table of these results files "
                             "into --doc's block ':summary'")
    args = parser.parse_args()
    if args.summary:
        table = summary_table(args.summary)
        write_doc_block(args.doc, table, ":summary")
        print(table)
        return
    if args.from_json is not None:
        table = render_results(args.from_json, render_table)
        write_doc_block(args.doc, table, args.doc_block)
        if args.readme is not None:
            write_doc_block(args.readme, "  " + render_results(args.from_json, range_line),
                            ":readme")
        print(table)
        return
    overrides = dict(parse_override(text) for text in args.overrides)
    claim = Claim(args.min_format_gain, args.min_mean_gain, args.min_standard_errors)
    with tempfile.TemporaryDirectory(prefix="vlmrl-learning-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        # seeds run at once share the cores: each process's CPU threads are capped to its share
        threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
        futures = [pool.submit(run_seed_or_failure, seed, overrides, Path(tmp), args.without_dvc,
                               threads) for seed in args.seeds]
        for future in concurrent.futures.as_completed(futures):
            print(json.dumps(future.result()), flush=True)
        runs = [future.result() for future in futures]
    failed = [run for run in runs if "error" in run]
    results = {"date": time.strftime("%Y-%m-%d"),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                          f"Python {platform.python_version()}",
               "seeds": args.seeds, "seed_keys": list(SEED_KEYS), "overrides": overrides,
               "runner": "stage commands" if args.without_dvc else "dvc repro post_eval",
               "jobs": args.jobs, "device": device_name(),
               "runs": runs, "summary": None if failed else summarize(runs, claim)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    if failed:
        raise SystemExit("\n".join(f"seed {run['seed']}: {run['error']}" for run in failed))
    table = render_table(results)
    if not args.no_doc:
        write_doc_block(args.doc, table, args.doc_block)
        if args.readme is not None:
            write_doc_block(args.readme, "  " + range_line(results), ":readme")
    print(table)


if __name__ == "__main__":
    main()
