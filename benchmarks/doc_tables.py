"""Every measured table of the docs, rewritten by the script that measured it from the results
JSON it stored under benchmarks/results/: nothing runs on a GPU, nothing is measured.

    python benchmarks/doc_tables.py           # rewrite every block of docs/benchmarks.md,
                                              # docs/benchmarks-history.md and README.md
    python benchmarks/doc_tables.py --check   # rewrite copies; list the blocks that differ

`--check` (run by tests/test_benchmark_docs.py) fails where a figure was typed into a block by
hand or a results file changed without its table. A new block goes into `TABLES`, with the
command that writes it.
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
DOCS = {"{doc}": "docs/benchmarks.md", "{history}": "docs/benchmarks-history.md",
        "{readme}": "README.md"}


def results_spec(name: str) -> str:
    """`name` (a results file's stem, or `stem::CONFIG,...`) as gspo_step.py's --from-json
    takes it."""
    stem, marker, configs = name.partition("::")
    return f"{RESULTS}/{stem}.json{marker}{configs}"


def gspo_step_block(block: str, *files: str, doc: str = "{history}") -> list[str]:
    return ["gspo_step.py", "--from-json", *(results_spec(name) for name in files),
            "--doc-block", block, "--doc", doc]


# Each entry: a script in benchmarks/ and its arguments; "{doc}", "{history}" and "{readme}"
# stand for the files in DOCS (or their copies under --check).
TABLES: tuple[list[str], ...] = (
    # docs/benchmarks.md: the current tables
    [*gspo_step_block("speed", "gspo_step_fp16_rows_2b", "gspo_step_wide_2b",
                      "gspo_step_issue41_2b::gpu_profile_mb8_spg4_rows16",
                      "gspo_step_fp16_rows_8b",
                      "gspo_step_rolled_compiled_8b::gpu_profile_graph_fp8_mb4_compiled",
                      "gspo_step_issue41_8b::gpu_profile_graph_fp8_before",
                      "gspo_step_fp8_cache::unsloth_4bit",
                      "gspo_step_8b_today::gpu_profile_mb8_spg4_rows16", doc="{doc}"),
     "--readme", "{readme}"],
    gspo_step_block("speed-h200x2-pool", "gspo_step_h200x2_pool_2b", "gspo_step_h200x2_pool_8b",
                    doc="{doc}"),
    gspo_step_block("h200x2-pool-2b", "gspo_step_h200x2_pool_2b", doc="{doc}"),
    gspo_step_block("h200x2-pool-8b", "gspo_step_h200x2_pool_8b", doc="{doc}"),
    gspo_step_block("speed-h200x2-pool-8b-again", "gspo_step_h200x2_pool_8b_again",
                    doc="{doc}"),
    gspo_step_block("speed-h200x2-8b-four", "gspo_step_h200x2_8b_four", doc="{doc}"),
    gspo_step_block("h200x2-8b-four", "gspo_step_h200x2_8b_four", doc="{doc}"),
    gspo_step_block("speed-h200", "gspo_step_h200x4_2b", "gspo_step_h200x4_8b", doc="{doc}"),
    gspo_step_block("speed-h200x2-side", "gspo_step_h200x2_side_2b", "gspo_step_h200x2_recipe_8b",
                    doc="{doc}"),
    gspo_step_block("h200x2-side-2b", "gspo_step_h200x2_side_2b", doc="{doc}"),
    gspo_step_block("h200x2-recipe-8b", "gspo_step_h200x2_recipe_8b", doc="{doc}"),
    gspo_step_block("speed-h200-parts", "gspo_step_h200_parts_bf16_8b", doc="{doc}"),
    gspo_step_block("h200-parts-8b", "gspo_step_h200_parts_bf16_8b", doc="{doc}"),
    gspo_step_block("speed-h200-images", "gspo_step_h200_images_2b", "gspo_step_h200_images_8b",
                    "gspo_step_h200_parts_bf16_8b::gpu_profile_graph_fp8_before", doc="{doc}"),
    gspo_step_block("h200-images-2b", "gspo_step_h200_images_2b", doc="{doc}"),
    gspo_step_block("h200-images-8b", "gspo_step_h200_images_8b", doc="{doc}"),
    gspo_step_block("speed-h200x2-reentrant", "gspo_step_h200x2_reentrant_2b", doc="{doc}"),
    gspo_step_block("h200x2-reentrant-2b", "gspo_step_h200x2_reentrant_2b", doc="{doc}"),
    gspo_step_block("h200-training-host-2b", "gspo_step_h200_training_host_2b", doc="{doc}"),
    gspo_step_block("speed-h200-pixels", "gspo_step_h200_pixels_2b", doc="{doc}"),
    gspo_step_block("speed-h200-nf4-linears", "gspo_step_h200_nf4_linears_2b", doc="{doc}"),
    gspo_step_block("speed-h200-nf4-linears-eager", "gspo_step_h200_nf4_linears_eager_2b",
                    doc="{doc}"),
    gspo_step_block("h200-pixels-2b", "gspo_step_h200_pixels_2b", doc="{doc}"),
    gspo_step_block("h200-nf4-linears-2b", "gspo_step_h200_nf4_linears_2b", doc="{doc}"),
    gspo_step_block("speed-h200x2-nf4-linears", "gspo_step_h200x2_nf4_linears_2b", doc="{doc}"),
    gspo_step_block("h200x2-nf4-linears-2b", "gspo_step_h200x2_nf4_linears_2b", doc="{doc}"),
    gspo_step_block("speed-h200x2-images", "gspo_step_h200x2_images_2b", doc="{doc}"),
    gspo_step_block("speed-h200x2-images-recipe", "gspo_step_h200x2_images_recipe_2b",
                    "gspo_step_h200x2_images_2b::gpu_profile_graph_fp8_before", doc="{doc}"),
    gspo_step_block("h200x2-images-2b", "gspo_step_h200x2_images_2b", doc="{doc}"),
    gspo_step_block("h200x2-images-recipe-2b", "gspo_step_h200x2_images_recipe_2b", doc="{doc}"),
    gspo_step_block("speed-h200-x2", "gspo_step_h200_2b",
                    "gspo_step_h200_unsloth_2b::unsloth_4bit", "gspo_step_h200_8b", doc="{doc}"),
    ["learning.py", "--summary", f"{RESULTS}/learning.json", f"{RESULTS}/learning_gpu_bf16.json",
     f"{RESULTS}/learning_gpu_nf4.json", f"{RESULTS}/learning_gpu_unsloth.json", "--doc", "{doc}"],
    ["scaling.py", "--render", f"{RESULTS}/scaling.json", "--out", f"{RESULTS}/scaling.json",
     "--doc", "{doc}"],
    ["pipeline.py", "--render", f"{RESULTS}/pipeline.json", "--doc", "{doc}"],
    ["decode_profile.py", "--from-json", f"{RESULTS}/decode_profile_h200_2b.json",
     f"{RESULTS}/decode_profile_h200_8b.json", f"{RESULTS}/decode_profile_h200_pdl_2b.json",
     f"{RESULTS}/decode_profile_h200_pdl_8b.json",
     f"{RESULTS}/decode_profile_h200_parts_float32_2b.json",
     f"{RESULTS}/decode_profile_h200_parts_bfloat16_2b.json",
     f"{RESULTS}/decode_profile_h200_prompt_reads_2b.json",
     f"{RESULTS}/decode_profile_h200_fused_sums_2b.json",
     f"{RESULTS}/decode_profile_attention_2b.json",
     f"{RESULTS}/decode_profile_groups_2b.json",
     f"{RESULTS}/decode_profile_ahead_2b.json",
     f"{RESULTS}/decode_profile_prmt_2b.json", f"{RESULTS}/decode_profile_fp8_2b.json",
     f"{RESULTS}/decode_profile_attention_8b.json",
     f"{RESULTS}/decode_profile_groups_8b.json", f"{RESULTS}/decode_profile_ahead_8b.json",
     f"{RESULTS}/decode_profile_prmt_8b.json",
     f"{RESULTS}/decode_profile_fp8_8b.json", "--doc", "{doc}"],
    ["decode_profile.py", "--from-json", f"{RESULTS}/decode_profile_h200_replay_2b.json",
     f"{RESULTS}/decode_profile_h200_parts_float32_8b.json",
     f"{RESULTS}/decode_profile_h200_parts_bfloat16_8b.json",
     f"{RESULTS}/decode_profile_h200_calls_2b.json",
     f"{RESULTS}/decode_profile_h200_calls_recorded_2b.json",
     f"{RESULTS}/decode_profile_h200_gaps_2b.json", "--table", "replays", "--doc", "{doc}"],
    ["decode_profile.py", "--from-json", f"{RESULTS}/decode_profile_h200_gaps_2b.json",
     "--table", "gaps", "--doc", "{doc}"],
    ["nf4_registers.py", "--from-json", f"{RESULTS}/nf4_registers.json", "--doc", "{doc}"],
    ["nf4_sweep.py", "--from-json", f"{RESULTS}/nf4_sweep_1.json", "--doc", "{doc}",
     "--doc-block", "-1"],
    ["nf4_sweep.py", "--from-json", f"{RESULTS}/nf4_sweep.json", "--doc", "{doc}",
     "--doc-block", "-2"],
    ["nf4_sweep.py", "--from-json", f"{RESULTS}/nf4_sweep_3.json", "--doc", "{doc}",
     "--doc-block", "-3"],
    ["nf4_sweep.py", "--from-json", f"{RESULTS}/nf4_sweep_4.json", "--before",
     f"{RESULTS}/nf4_sweep_4_before.json", "--doc", "{doc}", "--doc-block", "-4"],
    ["nf4_sweep.py", "--from-json", f"{RESULTS}/nf4_sweep_5.json", "--doc", "{doc}",
     "--doc-block", "-5"],
    ["nf4_sweep.py", "--from-json", f"{RESULTS}/nf4_sweep_6.json", "--doc", "{doc}",
     "--doc-block", "-6"],
    ["nf4_sweep.py", "--from-json", f"{RESULTS}/nf4_sweep_7.json", "--doc", "{doc}",
     "--doc-block", "-7"],
    gspo_step_block("h200x4-2b", "gspo_step_h200x4_2b", doc="{doc}"),
    gspo_step_block("h200x4-8b", "gspo_step_h200x4_8b", doc="{doc}"),
    gspo_step_block("h200x4-pdl", "gspo_step_h200x4_pdl", doc="{doc}"),
    gspo_step_block("h200x4-pdl-2b", "gspo_step_h200x4_pdl_2b", doc="{doc}"),
    gspo_step_block("h200-solo-2b", "gspo_step_h200_solo_2b", doc="{doc}"),
    gspo_step_block("h200-distinct-2b", "gspo_step_h200_distinct_2b", doc="{doc}"),
    gspo_step_block("h200-2b", "gspo_step_h200_2b", doc="{doc}"),
    gspo_step_block("h200-8b", "gspo_step_h200_8b", doc="{doc}"),
    gspo_step_block("h200-lanes-8b", "gspo_step_h200_lanes_8b", doc="{doc}"),
    gspo_step_block("fp16-rows-2b", "gspo_step_fp16_rows_2b", doc="{doc}"),
    gspo_step_block("fp16-rows-8b", "gspo_step_fp16_rows_8b", doc="{doc}"),
    gspo_step_block("rolled-compiled-2b", "gspo_step_rolled_compiled_2b", doc="{doc}"),
    gspo_step_block("rolled-compiled-8b", "gspo_step_rolled_compiled_8b", doc="{doc}"),
    gspo_step_block("rows48-8b", "gspo_step_rows48_8b", doc="{doc}"),
    gspo_step_block("wide-2b", "gspo_step_wide_2b", doc="{doc}"),
    gspo_step_block("wide-8b", "gspo_step_wide_8b", doc="{doc}"),
    gspo_step_block("compiled-2b", "gspo_step_compiled_2b", doc="{doc}"),
    gspo_step_block("compiled-8b", "gspo_step_compiled_8b", doc="{doc}"),
    gspo_step_block("rolled-2b", "gspo_step_rolled_2b", doc="{doc}"),
    gspo_step_block("attention-2b", "gspo_step_attention_2b", doc="{doc}"),
    gspo_step_block("attention-8b", "gspo_step_attention_8b", doc="{doc}"),
    gspo_step_block("training-profile-2b", "gspo_step_training_profile_2b", doc="{doc}"),
    gspo_step_block("training-profile-8b", "gspo_step_training_profile_8b", doc="{doc}"),
    gspo_step_block("groups-2b", "gspo_step_groups_2b", doc="{doc}"),
    gspo_step_block("groups-8b", "gspo_step_groups_8b", doc="{doc}"),
    gspo_step_block("ahead-2b", "gspo_step_ahead_2b", doc="{doc}"),
    gspo_step_block("prmt-2b", "gspo_step_prmt_2b", doc="{doc}"),
    gspo_step_block("prmt-8b", "gspo_step_prmt_8b", doc="{doc}"),
    gspo_step_block("issue41-2b", "gspo_step_issue41_2b", doc="{doc}"),
    gspo_step_block("issue41-8b", "gspo_step_issue41_8b", doc="{doc}"),
    gspo_step_block("issue41-8b-mb8", "gspo_step_issue41_8b_mb8", doc="{doc}"),
    gspo_step_block("fp8-cache-256", "gspo_step_fp8_cache_256", doc="{doc}"),
    gspo_step_block("fp8-cache", "gspo_step_fp8_cache", doc="{doc}"),
    gspo_step_block("8b-today", "gspo_step_8b_today", doc="{doc}"),
    ["learning.py", "--from-json", f"{RESULTS}/learning.json", "--doc", "{doc}",
     "--readme", "{readme}"],
    *(["learning.py", "--from-json", f"{RESULTS}/learning_gpu_{name}.json", "--doc-block",
       f":gpu-{name}", "--doc", "{doc}"] for name in ("bf16", "nf4", "unsloth")),
    ["launch_one_process.py", "--render", f"{RESULTS}/launch_one_process.json", "--doc", "{doc}"],
    ["cpu_kernels.py", "--from-json", f"{RESULTS}/cpu_kernels.json", "--doc", "{doc}"],
    # docs/benchmarks-history.md: superseded runs and the probes behind today's defaults
    ["nonfinite_probe.py", "--from-json", f"{RESULTS}/nonfinite_probe.json", "--doc",
     "{history}"],
    gspo_step_block("roofline", "gspo_step_roofline"),
    gspo_step_block("nf4-kernel", "gspo_step_nf4_kernel"),
    gspo_step_block("compiled-spans", "gspo_step_compiled_spans"),
    gspo_step_block("compiled", "gspo_step_compiled"),
    gspo_step_block("expandable", "gspo_step_expandable"),
    gspo_step_block("decode-kernel", "gspo_step_decode_kernel"),
    gspo_step_block("rows32", "gspo_step_rows32"),
    gspo_step_block("fp8-cache-other-machine", "gspo_step_fp8_cache_other_machine"),
    gspo_step_block("fp8-cache-warmup1", "gspo_step_fp8_cache_warmup1"),
)


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
                             "write, exit 1 if they do")
    args = parser.parse_args()
    if args.check:
        diffs = check()
        print("\n".join(diffs) or "every table is as its script writes it")
        return 1 if diffs else 0
    rewrite({key: ROOT / path for key, path in DOCS.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
