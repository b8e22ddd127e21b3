"""The tables `gspo_step.py` writes into the docs from stored results (nothing measured, no GPU):
one results file's full table (`roofline_table`: every run, its phases and whatever profiles it
kept) in a block of its own, and the speed summary of several files (`speed_table`: per model
shape and completion length, seconds per step, tokens per second and peak memory of each
configuration, with its speed against the Unsloth reference and against TRL's generate) in the
block `speed` or `speed-NAME`, whose longest-completion rows also go into the README's sentence.
A ratio is taken within one results file where it can be: two files are two device calls, often
two machines, and the spread between machines of one kind is larger than some of the changes
measured.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from doc_blocks import render_results, replace_between
from gspo_configs import CONFIGS, GPU_PROFILE, MODEL


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def doc_markers(block: str) -> tuple[str, str]:
    """The comment lines around a table block named `block` in the doc."""
    return f"<!-- gspo_step {block}: start -->", f"<!-- gspo_step {block}: end -->"


DOC_START, DOC_END = doc_markers("roofline")
# The two configurations every speed is set against: the seed notebooks' Unsloth setup, and
# TRL's own generate (transformers' static cache, compiled; NF4 weights).
REFERENCE, TRL_GENERATE = "unsloth_4bit", GPU_PROFILE


def roofline_table(results: dict[str, Any]) -> str:
    """One results file's full table: every measured run, with its speed against the Unsloth
    reference and TRL's generate of the same model and length, its phases, and the profiles it
    kept."""
    runs = [r for r in results["runs"].values() if not r.get("error")
            and r.get("seconds_per_step")]
    by_key = {(r["config"], r["completion_length"], r.get("model", MODEL)): r for r in runs}

    def ratio(run: dict[str, Any], config: str) -> str:
        base = by_key.get((config, run["completion_length"], run.get("model", MODEL)))
        if base is None or not base.get("generated_tokens_per_second"):
            return "-"
        return f"{run['generated_tokens_per_second'] / base['generated_tokens_per_second']:.2f}x"

    bandwidth = results.get("bandwidth_bytes_per_s")
    lines = [(f"Device: {results.get('device')}; copy bandwidth measured in the same run: "
             f"{_fmt(bandwidth / 1e12 if bandwidth else None, '.2f')} TB/s. Written by "
             "`benchmarks/gspo_step.py --doc`."), "",
             ("| model | configuration | tokens | s / step | generated tok/s | gen-only tok/s | "
             "decode steps/s | weights GB / step | % of bound | peak GiB (reserved) | "
             "vs unsloth_4bit | vs TRL's generate |"),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    order = {name: index for index, name in enumerate(CONFIGS)}
    runs = sorted(runs, key=lambda r: (r.get("model", MODEL), r["completion_length"],
                                       order.get(r["config"], 99)))
    for run in runs:
        fraction = run.get("bandwidth_fraction")
        weights = run.get("decode_weight_bytes")
        lines.append(
            f"| {model_name(run)} | `{run['config']}` | "
            f"{run['completion_length']} | {_fmt(run['seconds_per_step'], '.2f')} | "
            f"{_fmt(run['generated_tokens_per_second'], '.0f')} | "
            f"{_fmt(run['generation_only_tokens_per_second'], '.0f')} | "
            f"{_fmt(run.get('decode_steps_per_second'), '.1f')} | "
            f"{_fmt(weights / 1e9 if weights else None, '.2f')} | "
            f"{_fmt(100 * fraction if fraction else None, '.1f')} | "
            f"{_fmt(run['peak_allocated_gib'], '.2f')} ({_fmt(run['peak_reserved_gib'], '.2f')}) | "
            f"{ratio(run, REFERENCE)} | {ratio(run, TRL_GENERATE)} |")
    lines += phase_table(runs)
    lines += training_kernel_table(runs)
    lines += training_busy_table(runs)
    lines += training_host_table(runs)
    failed = sorted((key, run["error"]) for key, run in results["runs"].items()
                    if run.get("error"))
    if failed:
        lines += ["", "Runs without a result in this file:", ""]
        lines += [f"- `{key}`: {error}" for key, error in failed]
    return "\n".join(lines)


def model_name(run: dict[str, Any]) -> str:
    return run.get("model", MODEL).removeprefix("embedded:")


def micro_batch_seconds(run: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Forward plus backward seconds of each timed micro-batch (not those of the warm-up or of a
    profiled step after the timed ones): those that came first after a generation, and the
    others."""
    calls = run.get("phase_calls", {})
    generating = {g["step"] for g in run.get("generation_calls", [])}
    warmup = run.get("warmup_steps", 0)
    last = warmup + run["timed_steps"] if "timed_steps" in run else math.inf
    first, others, seen = [], [], set()
    for (step, loss), (_, backward) in zip(calls.get("loss", []), calls.get("backward", [])):
        if not warmup <= step < last:
            continue
        is_first = step in generating and step not in seen
        seen.add(step)
        (first if is_first else others).append(loss + backward)
    return first, others


# The parts of `prepare_inputs` (TRL's generation step) timed on their own.
INPUT_PARTS = ("prompts", "generation", "rewards", "old_logps")


def other_input_seconds(phases: dict[str, float]) -> float | None:
    """Seconds per step of `prepare_inputs` outside its timed parts (INPUT_PARTS): the host's
    work around a generation (completions decoded, masks and batches built, metrics gathered)."""
    if "prepare_inputs" not in phases:
        return None
    return phases["prepare_inputs"] - sum(phases.get(part, 0.0) for part in INPUT_PARTS)


def optimizer_seconds(run: dict[str, Any]) -> float | None:
    """Seconds per timed optimizer step outside its micro-batches' `training_step` calls: the
    optimizer's step, gradient clipping and zeroing, the scheduler and the callbacks."""
    in_steps = run.get("seconds_by_phase", {}).get("training_step")
    if in_steps is None or run.get("seconds_per_step") is None:
        return None
    return run["seconds_per_step"] - in_steps


def phase_table(runs: list[dict[str, Any]]) -> list[str]:
    """Seconds per optimizer step by phase (`seconds_by_phase`), and the micro-batches' forward
    plus backward seconds, the first after each generation apart; runs without phases are left
    out."""
    timed = [r for r in runs if r.get("seconds_by_phase")]
    if not timed:
        return []
    lines = ["", ("| model | configuration | tokens | generation | old log-probs | prompts | "
                  "other input work | forward | backward | optimizer and the rest | "
                  "first micro-batch after a generation, s | other micro-batches, mean s |"),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for run in timed:
        phases = run["seconds_by_phase"]
        first, others = micro_batch_seconds(run)
        lines.append(
            f"| {model_name(run)} | `{run['config']}` | {run['completion_length']} | "
            + " | ".join(_fmt(value, ".2f") for value in (
                phases.get("generation"), phases.get("old_logps"), phases.get("prompts"),
                other_input_seconds(phases), phases.get("loss"), phases.get("backward"),
                optimizer_seconds(run)))
            + f" | {', '.join(f'{t:.2f}' for t in first) or '-'} | "
            f"{_fmt(sum(others) / len(others) if others else None, '.2f')} |")
    return ["", ("Seconds per optimizer step by phase (`seconds_by_phase`, `phase_calls`; prompts: "
                 "TRL's `_tokenize_prompts`, the images' processing; other input work: the rest "
                 "of `_prepare_inputs` beyond its generation, old log-probs, prompts and "
                 "rewards; optimizer and the rest: each timed step's `step_seconds` beyond its "
                 "micro-batches' `training_step` calls, the optimizer's step, gradient "
                 "clipping and the callbacks):")] + lines


TRAINING_KERNELS_SHOWN = 12


def training_kernel_table(runs: list[dict[str, Any]]) -> list[str]:
    """The kernels of each run's profiled training step (`--profile-training`) that took the
    most device time, per optimizer step; runs without a profile are left out."""
    profiled = [r for r in runs if r.get("training_kernels")]
    if not profiled:
        return []
    lines = ["", (f"The {TRAINING_KERNELS_SHOWN} kernels of most device time in the profiled "
                  "training step (`--profile-training`, `training_kernels`; not in the timings "
                  "above):"), "",
             "| model | configuration | kernel | calls | ms |", "| --- | --- | --- | ---: | ---: |"]
    for run in profiled:
        for kernel in run["training_kernels"][:TRAINING_KERNELS_SHOWN]:
            name = kernel["kernel"].replace("|", "/")
            lines.append(f"| {model_name(run)} | `{run['config']}` | `{name}` | "
                         f"{kernel['calls_per_step']:.0f} | {kernel['ms_per_step']:.1f} |")
    return lines


def training_busy_table(runs: list[dict[str, Any]]) -> list[str]:
    """Each profiled micro-batch's wall seconds against the GPU's busy seconds
    (`training_busy`); runs without it are left out."""
    profiled = [r for r in runs if r.get("training_busy")]
    if not profiled:
        return []
    lines = ["", ("The profiled training step's micro-batches (`--profile-training`, "
                  "`training_busy`): wall seconds, the device synchronised at both ends and the "
                  "profiler on, against the GPU's busy seconds (the union of its kernels' "
                  "intervals); the rest of the wall time the GPU waited on the host:"), "",
             "| model | configuration | micro-batch | wall s | GPU busy s | busy share | kernels |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in profiled:
        for index, busy in enumerate(run["training_busy"], 1):
            lines.append(f"| {model_name(run)} | `{run['config']}` | {index} | "
                         f"{busy['wall_s']:.3f} | {busy['gpu_busy_s']:.3f} | "
                         f"{busy['gpu_busy_s'] / busy['wall_s']:.0%} | {busy['kernels']} |")
    return lines


TRAINING_HOST_SHOWN = 12


def training_host_table(runs: list[dict[str, Any]]) -> list[str]:
    """The functions of most own seconds in each run's cProfiled training step
    (`--profile-training-host`); runs without it are left out."""
    profiled = [r for r in runs if r.get("training_host_profile")]
    if not profiled:
        return []
    lines = ["", (f"The {TRAINING_HOST_SHOWN} functions of most own seconds on the host in "
                  "the cProfiled optimizer step (`--profile-training-host`, "
                  "`training_host_profile`: its micro-batches and its input work, the "
                  "generation left out; the profiler's cost included):"), "",
             "| model | configuration | function | calls | own s | cumulative s |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    for run in profiled:
        for row in run["training_host_profile"]["by_own"][:TRAINING_HOST_SHOWN]:
            name = row["function"].replace("|", "/")
            lines.append(f"| {model_name(run)} | `{run['config']}` | `{name}` | {row['calls']} | "
                         f"{row['own_s']:.3f} | {row['cumulative_s']:.3f} |")
    return lines


def write_doc_table(results: dict[str, Any], doc: Path, block: str = "roofline") -> None:
    """Replaces the text between the block's start and end markers in `doc` with
    `roofline_table`."""
    start, end = doc_markers(block)
    if start not in doc.read_text() or end not in doc.read_text():
        raise SystemExit(f"{doc}: no {start} ... {end} block to write the table into")
    replace_between(doc, start, end, roofline_table(results))


SPEED_BLOCK = "speed"


def measured_runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of one results file that finished, each with the fields the speed summary
    reads (a missing one raises KeyError, which `render_results` names)."""
    runs = []
    for run in results["runs"].values():
        if run.get("error"):
            continue
        runs.append({key: run[key] for key in (
            "config", "completion_length", "seconds_per_step", "generated_tokens_per_second",
            "peak_allocated_gib", "peak_reserved_gib")} | {"model": run.get("model", MODEL)})
    return runs


def results_source(spec: Path) -> tuple[Path, set[str] | None]:
    """`FILE` (every run of it) or `FILE::CONFIG,CONFIG` (those configurations' runs only)."""
    path, _, configs = str(spec).partition("::")
    return Path(path), set(configs.split(",")) if configs else None


def speed_rows(files: list[Path]) -> list[dict[str, Any]]:
    """Each (model, tokens, configuration) from the first file that measured it, tagged with
    that file; sorted by model, tokens and `CONFIGS` order."""
    chosen: dict[tuple[str, int, str], dict[str, Any]] = {}
    for spec in files:
        path, configs = results_source(spec)
        for run in render_results(path, measured_runs):
            if configs is not None and run["config"] not in configs:
                continue
            key = (run["model"], run["completion_length"], run["config"])
            chosen.setdefault(key, {**run, "file": path.name})
    order = {name: index for index, name in enumerate(CONFIGS)}
    return sorted(chosen.values(), key=lambda r: (r["model"], r["completion_length"],
                                                  order.get(r["config"], 99)))


def speed_base(run: dict[str, Any], rows: list[dict[str, Any]], config: str
               ) -> tuple[dict[str, Any] | None, str]:
    """`config`'s row to set `run` against, with its mark: the same model and tokens (marked
    † where it is from another results file), else the same model at another length of the same
    file (‡: the reference's longer completions do not fit one device call beside the others)."""
    same_model = [r for r in rows if r["config"] == config and r["model"] == run["model"]]
    for base in same_model:
        if base["completion_length"] == run["completion_length"]:
            return base, "" if base["file"] == run["file"] else " †"
    for base in same_model:
        if base["file"] == run["file"]:
            return base, " ‡"
    return None, ""


def speed_ratio(run: dict[str, Any], rows: list[dict[str, Any]], config: str) -> str:
    """Generated tokens/s over those of `config`'s row (`speed_base`), with its mark."""
    base, mark = speed_base(run, rows, config)
    if base is None:
        return "-"
    return f"{run['generated_tokens_per_second'] / base['generated_tokens_per_second']:.2f}x{mark}"


def speed_table(files: list[Path], block: str = SPEED_BLOCK) -> str:
    """The speed summary: per model shape and completion length, seconds per GSPO step,
    generated tokens per second and peak memory of each configuration, with its speed against
    the Unsloth reference and TRL's generate."""
    rows = speed_rows(files)
    machines = sorted({render_results(results_source(spec)[0], machine_line) for spec in files})
    lines = [(f"{'; '.join(machines)}; 16 completions per optimizer step, LoRA r16. Written by "
              f"`benchmarks/gspo_step.py --from-json ... --doc-block {block}`. Ratios: generated "
              "tokens/s against that configuration's run on the same model shape and "
              "completion length in the same results file (one device call); † in another "
              "results file (another machine of the kind); ‡ at another completion length of "
              "the same file."),
             "",
             ("| model | tokens | configuration | s / step | generated tok/s | "
              "peak GiB (reserved) | vs unsloth_4bit | vs TRL's generate | results file |"),
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for run in rows:
        lines.append(
            f"| {model_name(run)} | {run['completion_length']} | `{run['config']}` | "
            f"{run['seconds_per_step']:.2f} | {run['generated_tokens_per_second']:.0f} | "
            f"{run['peak_allocated_gib']:.2f} ({run['peak_reserved_gib']:.2f}) | "
            f"{speed_ratio(run, rows, REFERENCE)} | {speed_ratio(run, rows, TRL_GENERATE)} | "
            f"`{run['file']}` |")
    return "\n".join(lines)


def machine_line(results: dict[str, Any]) -> str:
    """The device and the library versions a results file was measured with."""
    versions = results["versions"]
    return results["device"] + ", " + ", ".join(
        f"{name} {versions[name]}" for name in ("torch", "transformers", "trl", "peft",
                                                "bitsandbytes", "unsloth"))


def device_of(results: dict[str, Any]) -> str:
    return results["device"]


def speed_line(files: list[Path]) -> str:
    """The speed summary as one sentence per model shape, for the README: each configuration at
    its longest completions."""
    rows = speed_rows(files)
    sentences = []
    for model in sorted({r["model"] for r in rows}):
        longest = {r["config"]: r for r in rows if r["model"] == model}  # sorted by length
        parts = [f"`{r['config']}` at {r['completion_length']} tokens "
                 f"{r['seconds_per_step']:.2f} s per step "
                 f"({r['generated_tokens_per_second']:.0f} tokens/s), peak "
                 f"{r['peak_allocated_gib']:.2f} GiB" for r in longest.values()]
        sentences.append(f"{model.removeprefix('embedded:')}: " + "; ".join(parts) + ".")
    devices = sorted({render_results(results_source(spec)[0], device_of) for spec in files})
    return (" ".join(sentences) + f" Measured by `benchmarks/gspo_step.py` on "
            f"{' and '.join(devices)}.")


def write_from_json(files: list[Path], doc: Path, block: str, readme: Path | None) -> None:
    """The block's table from stored results: the speed summary of several files (the block
    `speed`, or one named `speed-...`; only `speed` writes the README's sentence), or one file's
    full table."""
    if block == SPEED_BLOCK or block.startswith(f"{SPEED_BLOCK}-"):
        replace_between(doc, *doc_markers(block), speed_table(files, block))
        if readme is not None and block == SPEED_BLOCK:
            replace_between(readme, *doc_markers("speed-readme"), speed_line(files))
        return
    if len(files) != 1:
        raise SystemExit(f"--doc-block {block}: one results file, got {len(files)} (only the "
                         f"{SPEED_BLOCK!r} block merges several)")
    if results_source(files[0])[1] is not None:
        raise SystemExit(f"--doc-block {block}: a whole results file, not {files[0]} (only the "
                         f"{SPEED_BLOCK!r} block takes some configurations of a file)")
    start, end = doc_markers(block)
    replace_between(doc, start, end, render_results(results_source(files[0])[0], roofline_table))
