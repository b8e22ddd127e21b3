"""What `scaling.py` makes of its ranks' records: each rank's seconds per optimizer step by phase,
a run's tokens per second (all ranks' tokens over the slowest rank's time: the ranks step
together), the speedups of two processes over one against their goals, and the tables
`--render` writes (the summary that answers whether a second GPU pays, and the phases per rank
and the 8B shape's memory under it). Arithmetic only: unit-tested on records made by hand.
"""

from __future__ import annotations

import statistics
from typing import Any

GOALS = {"strong": 1.5, "weak": 1.8}  # tokens/s against one process
PHASES = ("generation", "old_logps", "forward", "backward", "all_reduce", "wait", "other")
PHASE_TITLES = {"generation": "generation", "old_logps": "old log-probs", "forward": "forward",
                "backward": "backward", "all_reduce": "all-reduce", "wait":
                "waiting for the slower rank", "other": "other"}


def _timed(pairs: list[list[Any]], warmup: int) -> list[list[Any]]:
    return [pair for pair in pairs if pair[0] >= warmup]


def rank_phases(record: dict[str, Any], warmup: int) -> dict[str, float | None]:
    """Seconds per timed optimizer step of one rank, by phase (PHASES), and `step`: the mean
    step. The backward of a synced micro-batch beyond the mean unsynced one is the all-reduce
    (None where no micro-batch ran unsynced: no gradient accumulation, or one process, where
    there is none: 0); `other` is the rest of the step (rewards, the optimizer, logging)."""
    steps = _timed(record["steps"], warmup)
    if not steps:
        return {phase: None for phase in (*PHASES, "step")}
    count = len(steps)
    totals: dict[str, float] = {}
    backward_plain, backward_sync = [], []
    for phase, step, seconds in record["calls"]:
        if step < warmup:
            continue
        if phase == "backward_sync":
            backward_sync.append(seconds)
        else:
            totals[phase] = totals.get(phase, 0.0) + seconds
        if phase == "backward":
            backward_plain.append(seconds)
    all_reduce: float | None = 0.0
    if backward_sync:
        if backward_plain:
            plain = statistics.mean(backward_plain)
            all_reduce = sum(max(0.0, t - plain) for t in backward_sync)
        else:
            all_reduce = None
        totals["backward"] = totals.get("backward", 0.0) + sum(backward_sync) - (all_reduce or 0)
    step_total = sum(seconds for _, seconds in steps)
    per_step = {phase: totals.get(phase, 0.0) / count
                for phase in ("generation", "old_logps", "forward", "backward", "wait")}
    per_step["all_reduce"] = None if all_reduce is None else all_reduce / count
    per_step["step"] = step_total / count
    per_step["other"] = per_step["step"] - sum(
        value for key, value in per_step.items() if key != "step" and value is not None)
    return {key: round(value, 4) if value is not None else None
            for key, value in per_step.items()}


def run_summary(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One run from its ranks' records: seconds per optimizer step (the slowest rank's: the
    ranks step together), generated tokens per second over the timed steps (all ranks' tokens),
    completions per step in all and per GPU, and each rank's phases and memory."""
    failed = [r["error"] for r in records if r.get("error")]
    if failed or not records:
        return {"error": failed[0] if failed else "no rank wrote a record"}
    seconds = max(sum(s for _, s in _timed(r["steps"], warmup)) for r in records)
    timed_steps = min(len(_timed(r["steps"], warmup)) for r in records)
    tokens = sum(t for r in records for step, t, _ in r["tokens"] if step >= warmup)
    completions = sum(c for r in records for step, _, c in r["tokens"] if step >= warmup)
    ranks = sorted(records, key=lambda r: r["rank"])
    return {
        "processes": len(records), "timed_steps": timed_steps,
        "seconds_per_step": round(seconds / timed_steps, 3) if timed_steps else None,
        "generated_tokens_per_second": round(tokens / seconds, 1) if seconds else None,
        "completions_per_step": completions / timed_steps if timed_steps else None,
        "completions_per_step_per_gpu": (completions / timed_steps / len(records)
                                         if timed_steps else None),
        "mean_completion_tokens": round(tokens / completions, 1) if completions else None,
        "ranks": [{"rank": r["rank"], "phases": rank_phases(r, warmup),
                   **{key: r.get(key) for key in ("peak_allocated_gib", "peak_reserved_gib",
                                                  "device_used_gib", "allreduce_probe_s",
                                                  "trainable_parameters", "train_seconds")}}
                  for r in ranks],
    }


def speedups(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Tokens per second of `strong` and `weak` over `one`'s (None where either is missing)."""
    base = runs.get("one", {}).get("generated_tokens_per_second")
    return {name: (round(runs[name]["generated_tokens_per_second"] / base, 2)
                   if base and runs.get(name, {}).get("generated_tokens_per_second") else None)
            for name in GOALS}


# ------------------------------------------------------------------ tables

def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def ratio_cell(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio is not None else "-"


def verdict(name: str, speedup: float | None) -> str:
    if speedup is None:
        return f"{name} scaling: not measured"
    met = "met" if speedup >= GOALS[name] else "not met"
    return f"{name} scaling: **{speedup:.2f}x** tokens/s (goal {GOALS[name]}x: {met})"


def where_time_goes(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Rank 0's generation and training seconds per step, 1 process against each 2-process run,
    from the phase table (so the reason for a shortfall is read, not guessed)."""
    one = runs.get("one", {}).get("ranks")
    lines = []
    for name in GOALS:
        other = runs.get(name, {}).get("ranks")
        if not (one and other):
            continue
        a, b = one[0]["phases"], other[0]["phases"]
        train_a = sum(a[k] or 0 for k in ("old_logps", "forward", "backward"))
        train_b = sum(b[k] or 0 for k in ("old_logps", "forward", "backward"))
        lines.append(
            f"- {name}: per optimizer step, generation {_fmt(a['generation'], '.2f')} s on 1 "
            f"process and {_fmt(b['generation'], '.2f')} s on each of 2; old log-probs + forward "
            f"+ backward {train_a:.2f} s and {train_b:.2f} s; all-reduce "
            f"{_fmt(b['all_reduce'], '.3f')} s, waiting {_fmt(b['wait'], '.3f')} s, other "
            f"{_fmt(a['other'], '.2f')} s and {_fmt(b['other'], '.2f')} s.")
    return lines


def scaling_summary(results: dict[str, Any]) -> str:
    """Tokens per second on 1 and 2 GPUs and the verdicts against the goals: the table that
    answers whether a second GPU pays (block `:summary`)."""
    runs = results["runs"]
    lines = [(f"{results['device']}; the ranks' seconds and tokens over the timed "
             "optimizer steps after the warm-up ones. Written by `benchmarks/scaling.py "
             "--render`."), "",
             ("| run | processes | completion tokens | warm-up + timed steps | completions / step "
             "(per GPU) | s / step | generated tok/s | vs 1 process |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    gains = speedups(runs)
    for name in ("one", "strong", "weak"):
        run = runs.get(name)
        if run is None:
            continue
        if run.get("error"):
            lines.append(f"| {name} | - | - | - | - | - | - | {run['error'][:120]} |")
            continue
        lines.append(f"| {name} | {run['processes']} | {run.get('completion_length', '-')} | "
                     f"{run.get('warmup_steps', '-')} + {run['timed_steps']} | "
                     f"{_fmt(run['completions_per_step'], '.0f')} "
                     f"({_fmt(run['completions_per_step_per_gpu'], '.0f')}) | "
                     f"{_fmt(run['seconds_per_step'], '.2f')} | "
                     f"{_fmt(run['generated_tokens_per_second'], '.0f')} | "
                     f"{ratio_cell(1.0 if name == 'one' else gains.get(name))} |")
    lines += ["", *(f"- {verdict(name, gains[name])}" for name in GOALS)]
    return "\n".join(lines)


def scaling_table(results: dict[str, Any]) -> str:
    """Where the time goes, per phase and rank, and the 8B shape's memory one GPU against two
    sharded: the details under the summary (this script's unnamed block)."""
    runs = results["runs"]
    lines = [("Seconds per optimizer step by phase and rank (mean over the timed steps; "
              "all-reduce: the synced backward beyond the unsynced one; waiting: at a barrier "
              "after each generation and before each synced backward):"), "",
             "| run | rank | " + " | ".join(PHASE_TITLES[p] for p in PHASES) + " | step | "
             "all-reduce of the LoRA gradients alone, ms |",
             "| --- | ---: |" + " ---: |" * (len(PHASES) + 2)]
    for name in ("one", "strong", "weak"):
        for rank in runs.get(name, {}).get("ranks", []):
            phases = rank["phases"]
            probe = rank.get("allreduce_probe_s")
            lines.append(f"| {name} | {rank['rank']} | "
                         + " | ".join(_fmt(phases[p], ".3f") for p in PHASES)
                         + f" | {_fmt(phases['step'], '.2f')} | "
                         f"{_fmt(probe * 1000 if probe is not None else None, '.2f')} |")
    explained = where_time_goes(runs)
    if explained:
        lines += ["", "Where the time goes (rank 0):", "", *explained]
    lines += memory_table(runs)
    return "\n".join(lines)


def memory_table(runs: dict[str, dict[str, Any]]) -> list[str]:
    shown = [name for name in ("8b_one", "8b_sharded") if name in runs]
    if not shown:
        return []
    lines = ["", "The 8B shape in bf16, one GPU against two sharded (figures per GPU, rank order):",
             "", ("| run | strategy | processes | completion tokens | s / step | "
                  "peak allocated GiB | peak reserved GiB | device used at the end GiB |"),
             "| --- | --- | ---: | ---: | ---: | --- | --- | --- |"]
    for name in shown:
        run = runs[name]
        if run.get("error"):
            lines.append(f"| {name} | {run.get('strategy', '-')} | - | - | - | "
                         f"{run['error'][:120]} | - | - |")
            continue
        per_gpu = {key: ", ".join(_fmt(r.get(key), ".2f") for r in run["ranks"])
                   for key in ("peak_allocated_gib", "peak_reserved_gib", "device_used_gib")}
        lines.append(f"| {name} | {run.get('strategy', '-')} | {run['processes']} | "
                     f"{run.get('completion_length', '-')} | "
                     f"{_fmt(run['seconds_per_step'], '.2f')} | {per_gpu['peak_allocated_gib']} | "
                     f"{per_gpu['peak_reserved_gib']} | {per_gpu['device_used_gib']} |")
    return lines
