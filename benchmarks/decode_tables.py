"""The tables `decode_profile.py --from-json` writes into the docs from stored runs (no GPU):
`kernels`, where one decode step's time goes by kernel family; `replays`, the step's graph
replayed back to back against a generate call's own parts; `gaps`, the GPU's idle time between a
replay's kernels. A kernel family is named by its kernels' name prefixes (`KERNEL_GROUPS`), the
same families `decode_profile.kernel_family` sorts a trace's gaps by.
"""

from __future__ import annotations

from pathlib import Path

from doc_blocks import render_results

KERNEL_GROUPS = (("NF4 projections", ("nf4_lora_matmul",)), ("sum of the splits", ("sum_splits",)),
                 ("attention over the cache", ("partial_attention", "merge_shares")),
                 ("LM head", ("nvjet",)))
EXTRA_COLUMNS = ("other kernels", "between kernels")


def tiles_note(results: dict) -> str:
    """The decode tiles of a `--decode-tiles` run where they are not the shipped ones."""
    from vlmrl.training.rollout.nf4_decode import TILES

    chosen = results.get("decode_tiles") or {}
    changed = [f"{name}={value}" for name, value in chosen.items()
               if getattr(TILES, name) != value]
    return f" (tiles: {', '.join(changed)})" if changed else ""


def short_device(name: str) -> str:
    """"NVIDIA H100 80GB HBM3 (79 GiB)" as "H100 80GB HBM3"."""
    return name.removeprefix("NVIDIA ").split(" (")[0]


def kernel_rows(results: dict) -> list[str]:
    """One row per profiled run of a results file: milliseconds per decode step, and each group of
    KERNEL_GROUPS' kernel time per step with its share of the step (the rest: the other kernels
    and the gaps between them)."""
    rows = []
    for run in results["runs"]:
        if "kernels" not in run:
            continue
        total = run["ms_per_step"]
        grouped = [sum(k["ms_per_step"] for k in run["kernels"] if k["kernel"].startswith(prefixes))
                   for _, prefixes in KERNEL_GROUPS]
        every = run.get("all_kernels")  # EXTRA_COLUMNS: where the run kept every kernel's total
        extra = [every["ms_per_step"] - sum(grouped), total - every["ms_per_step"]] if every \
            else [None] * len(EXTRA_COLUMNS)
        shares = [f"{ms:.2f} ({100 * ms / total:.0f}%)" if ms is not None else "-"
                  for ms in grouped + extra]
        label = " (a launch per projection)" if run.get("nf4_groups") == "off" else ""
        rows.append(f"| {results['model'].removeprefix('embedded:')}{tiles_note(results)}"
                    f"{label} | {short_device(results['device'])} | "
                    f"{run['rows']} | "
                    f"{results['kv_cache_dtype']} | {run['ms_per_step']:.2f} | "
                    f"{run['tokens_per_s']} | {100 * run['bound_fraction']:.1f} | "
                    + " | ".join(shares) + " |")
    return rows


def kernel_table(files: list[Path]) -> str:
    header = " | ".join(f"{name}, ms (share)" for name in
                        [*(name for name, _ in KERNEL_GROUPS), *EXTRA_COLUMNS])
    lines = [("Written by `benchmarks/decode_profile.py --from-json ... --doc`: one decode step "
             "of the compiled graph (NF4 kernel, grouped attention), timed over 256 steps, its "
             "kernels profiled over 8 replayed steps (share: of the step); % of bound: the weights' bytes per step against the copy "
             "bandwidth measured in the same call; other kernels: every other kernel of the "
             "step, between kernels: the step's time outside any kernel (runs that kept "
             "every kernel's total: `--top`)."), "",
             (f"| model | device | rows | KV cache | ms / step | tok/s | % of bound | {header} "
              "| results file |"),
             "| --- | --- | ---: | --- | ---: | ---: | ---: |"
             + " ---: |" * (len(KERNEL_GROUPS) + len(EXTRA_COLUMNS))
             + " --- |"]
    return table_of(lines, files, kernel_rows)


def table_of(lines: list[str], files: list[Path], rows) -> str:
    """A table's caption and header (`lines`), then `rows` of each results file, named in the
    last column."""
    for path in files:
        lines = [*lines, *(f"{row} `{path.name}` |" for row in render_results(path, rows))]
    return "\n".join(lines)


CALL_TOKENS = 1024  # --call-tokens' default (the results before it was recorded used it)


def replay_rows(results: dict) -> list[str]:
    """One row per run that timed its graph's replays (`replay_ms`), and with `--call-phases` one
    per decoder (kept between calls, or made anew each call as the "graph" mode trains): the
    steady calls' (all but the first) mean seconds, their parts, and their later decode steps'
    milliseconds each."""
    rows = []
    for run in results["runs"]:
        if "replay_ms" not in run:
            continue
        replay = run["replay_ms"]["64"]
        head = (f"| {results['model'].removeprefix('embedded:')}{tiles_note(results)} | "
                f"{short_device(results['device'])} | {run['ms_per_step']:.2f} | "
                f"{replay['gpu_ms']:.2f} | {replay['host_ms']:.3f} |")
        steps = run.get("call_tokens", CALL_TOKENS) - 2  # after the prefill's and the first
        for decoder, calls in (run.get("call_phases") or {"-": []}).items():
            steady = calls[1:]
            if not steady:
                rows.append(head + " - |" * 6)
                continue
            mean = {key: sum(call[key] for call in steady) / len(steady)
                    for key in ("call_s", "prefill_s", "first_step_s")}
            later = (mean["call_s"] - mean["prefill_s"] - mean["first_step_s"]) * 1000 / steps
            rows.append(head + f" {decoder} | {len(steady)} | {mean['call_s']:.2f} | "
                        f"{mean['prefill_s']:.3f} | {mean['first_step_s']:.3f} | {later:.2f} |")
    return rows


def replay_table(files: list[Path]) -> str:
    lines = [("Written by `benchmarks/decode_profile.py --from-json ... --table replays`: the "
              "decode step of the compiled graph (NF4 kernel, grouped attention, 32 rows) timed "
              "over 256 steps of a call, its prefill included (ms / step); its graph replayed 64 "
              "times back to back after that call (the cache filled to the prompt and 256 "
              "tokens), on the GPU (CUDA events) and on the host (the launches alone); with "
              "`--call-phases`, generate calls of 1024 tokens (the calls after each decoder's "
              "first, mean), synchronised around the prefill and the first decode step (for a "
              "decoder made anew each call: its cache and the graph's capture), and the later "
              "steps' milliseconds each (over a cache filled further: longer attention)."), "",
             ("| model | device | ms / step | replay on the GPU, ms | replay on the host, ms | "
              "decoder | calls | call s | prefill s | first step s | later steps, ms each | "
              "results file |"),
             "| --- | --- | ---: | ---: | ---: | --- |" + " ---: |" * 5 + " --- |"]
    return table_of(lines, files, replay_rows)


def gap_rows(results: dict) -> list[str]:
    """One row per run that traced its replays (`--gaps`): the GPU's idle time between the
    kernels of a replay, and the transitions that hold most of it."""
    rows = []
    for run in results["runs"]:
        gaps = run.get("replay_ms", {}).get("gaps")
        if gaps is None:
            continue
        replay_us = run["replay_ms"]["64"]["gpu_ms"] * 1000
        largest = "; ".join(f"{row['transition']}: {row['us_per_replay']:.0f} "
                            f"({row['per_replay']:g} x {row['mean_us']:.2f})"
                            for row in gaps["transitions"][:4])
        rows.append(f"| {results['model'].removeprefix('embedded:')} | "
                    f"{short_device(results['device'])} | {replay_us / 1000:.2f} | "
                    f"{gaps['kernels_per_replay']:g} | {gaps['gap_us_per_replay']:.0f} "
                    f"({100 * gaps['gap_us_per_replay'] / replay_us:.0f}%) | {largest} |")
    return rows


GAPS_CAPTION = (
    "Written by `benchmarks/decode_profile.py --from-json ... --table gaps`: the decode step's "
    "graph (NF4 kernel, grouped attention, 32 rows) replayed 8 times back to back, traced by "
    "torch.profiler: the GPU's idle time between one kernel's end and the next one's start, per "
    "replay (share: of the replay's time on the GPU, from 64 replays timed by CUDA events), and "
    "the transitions (kernel before -> after) that hold the most of it: microseconds per replay "
    "(times per replay x mean microseconds).")
GAPS_HEADER = ("| model | device | replay on the GPU, ms | kernels per replay | idle between "
               "kernels, us per replay (share) | largest transitions | results file |\n"
               "| --- | --- | ---: | ---: | ---: | --- | --- |")


def gap_table(files: list[Path]) -> str:
    return table_of([GAPS_CAPTION, "", GAPS_HEADER], files, gap_rows)
