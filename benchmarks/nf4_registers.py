"""Registers per thread of the NF4 decode kernel (`vlmrl.training.rollout.nf4_kernels.nf4_lora_matmul`),
compiled ahead of time for an H100 (sm_90) by this machine's Triton and its ptxas: no GPU needed.

Why: the kernel is bound by the latency of its steps more than by bytes (docs/benchmarks.md), and
an SM keeps 64K registers, so the registers of a program bound how many programs an SM keeps at
once to hide that latency. A kernel gets the registers of its costliest path; this table shows
which path that is, per projection shape of the 2B and 8B models at 32 rows (adapter on, nested
scales, as the decode steps run), for the shipped tiles and the `Tiles` options that lower them.
The launch arguments are the ones `nf4_matmul` passes (recorded from it on the CPU, with the SMs
of an H100), specialized as Triton's launcher does (16-byte aligned pointers, integers divisible
by 16).

    python benchmarks/nf4_registers.py --out benchmarks/results/nf4_registers.json --doc docs/benchmarks.md
    python benchmarks/nf4_registers.py --from-json benchmarks/results/nf4_registers.json --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
from doc_blocks import render_results, write_doc_block

from vlmrl.training.rollout import nf4_decode
from vlmrl.training.rollout.nf4_decode import TILES, PackedNF4, Tiles

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qwen3-vl-2b-shape": [(2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144)],
          "qwen3-vl-8b-shape": [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)]}
# One scale block a K step, the adapter in float32 on CUDA cores (the tiles before the wide
# kernel), the options that lower its registers, the adapter in tf32; `shipped`: TILES
# (nf4_lora_matmul_wide), the same with the adapter in tf32 (as shipped before the fp16 one),
# and with four blocks a step.
NARROW = Tiles(block_n=128)
VARIANTS = {"before": NARROW, "xa_chunk=16": dataclasses.replace(NARROW, xa_chunk=16),
            "xa_chunk=16, max_registers=168": dataclasses.replace(NARROW, xa_chunk=16,
                                                                  max_registers=168),
            "xa tf32": dataclasses.replace(NARROW, xa_precision="tf32"),
            "shipped, xa tf32": dataclasses.replace(TILES, xa_precision="tf32"),
            "shipped": TILES, "four blocks a step": dataclasses.replace(TILES, k_blocks=4)}
ROWS, RANK, SMS = 32, 16, 132  # the decode step's rows, the recipes' LoRA rank, an H100's SMs
SM_REGISTERS, SM_THREADS = 65536, 2048
TYPES = {torch.uint8: "*u8", torch.bfloat16: "*bf16", torch.float32: "*fp32",
         torch.float16: "*fp16"}


def recorded_launch(out_features: int, in_features: int, tiles: Tiles) -> tuple[dict, dict]:
    """(arguments by name, compile options) of the first kernel as `nf4_matmul` launches it for
    ROWS rows of x, an adapter of rank RANK and nested block scales."""
    launches = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, args, kwargs))

    blocks = out_features * in_features // 64
    weight = PackedNF4(torch.zeros(out_features * in_features // 2, 1, dtype=torch.uint8),
                       torch.zeros(in_features // 64, out_features, dtype=torch.uint8),
                       out_features, in_features, 64, torch.zeros(-(-blocks // 256)),
                       torch.zeros(256), 0.01)
    lora = (torch.zeros(RANK, in_features), torch.zeros(out_features, RANK), 2.0)
    import triton

    kernel, saved = nf4_decode._kernel, nf4_decode._sm_count
    nf4_decode._kernel = lambda: (triton, Recorder("nf4_lora_matmul"), Recorder("sum_splits"),
                                  Recorder("nf4_lora_matmul_wide"))
    nf4_decode._sm_count = lambda device: SMS
    try:
        nf4_decode.nf4_matmul(torch.zeros(ROWS, in_features, dtype=torch.bfloat16), weight, lora,
                              tiles)
    finally:
        nf4_decode._kernel, nf4_decode._sm_count = kernel, saved
    name, args, kwargs = launches[0]
    names = kernel_named(name).arg_names
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "maxnreg")
               if key in kwargs}
    kwargs.pop("launch_pdl", None)
    return {"kernel": name, **dict(zip(names, args)), **kwargs}, options


def kernel_named(name: str):
    from vlmrl.training.rollout import nf4_kernels

    return getattr(nf4_kernels, name)


def compile_stats(arguments: dict, options: dict) -> dict:
    """Registers per thread, spilled bytes and shared memory of the kernel compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = kernel_named(arguments["kernel"])
    signature, constexprs, aligned = {}, {}, []
    for index, name in enumerate(kernel.arg_names):
        value = arguments[name]
        if index in kernel.constexprs:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = TYPES[value.dtype]
            aligned.append(index)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                aligned.append(index)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                       attrs={(index,): [["tt.divisibility", 16]] for index in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as work:
        ptx = Path(work) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o",
                                 str(Path(work) / "kernel.cubin")],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    threads = 32 * options["num_warps"]
    per_sm = min(SM_REGISTERS // (-(-registers // 8) * 8 * threads), SM_THREADS // threads)
    return {"registers": registers, "spill_bytes": spilled,
            "shared_bytes": compiled.metadata.shared,
            "programs_per_sm_by_registers": per_sm}


def measure() -> dict:
    import triton

    results = {"triton": triton.__version__, "target": "sm_90", "rows": ROWS, "rank": RANK,
               "sms": SMS, "runs": []}
    for model, shapes in SHAPES.items():
        for out_features, in_features in shapes:
            for variant, tiles in VARIANTS.items():
                arguments, options = recorded_launch(out_features, in_features, tiles)
                step = arguments["QBLOCK"] * arguments.get("KB", 1)
                run = {"model": model, "out": out_features, "in": in_features,
                       "variant": variant, "tiles": dataclasses.asdict(tiles),
                       "kernel": arguments["kernel"], "k_steps": arguments["K_SPLIT"] // step,
                       **compile_stats(arguments, options)}
                print(json.dumps(run), flush=True)
                results["runs"].append(run)
    return results


def table(results: dict) -> str:
    variants = list(dict.fromkeys(run["variant"] for run in results["runs"]))
    kernels = {run["variant"]: run["kernel"] for run in results["runs"]}
    cells: dict[tuple, dict] = {}
    for run in results["runs"]:
        cells.setdefault((run["model"], run["out"], run["in"]), {})[run["variant"]] = (
            f"{run['registers']} ({run['spill_bytes']} B) / {run['programs_per_sm_by_registers']}"
            f" / {run['k_steps']}")
    names = ", ".join(f"`{kernel}`" for kernel in dict.fromkeys(kernels.values()))
    caption = (f"Written by `benchmarks/nf4_registers.py`: {names} compiled for "
               f"{results['target']} by Triton {results['triton']} and its ptxas, launched as "
               f"`nf4_matmul` launches it for {results['rows']} rows, an adapter of rank "
               f"{results['rank']} and nested scales on {results['sms']} SMs. Each cell: "
               "registers per thread (bytes spilled) / programs an SM can keep by its registers "
               "/ K steps a program.")
    lines = [caption, "",
             "| model | out x in | " + " | ".join(f"`{v}` ({kernels[v]})" for v in variants)
             + " |", "| --- | --- |" + " ---: |" * len(variants)]
    for (model, out_features, in_features), by_variant in cells.items():
        lines.append(f"| {model} | {out_features} x {in_features} | "
                     + " | ".join(by_variant[v] for v in variants) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("nf4_registers.json"))
    parser.add_argument("--from-json", type=Path, metavar="RESULTS",
                        help="compile nothing: write the table of these results into --doc")
    parser.add_argument("--doc", type=Path)
    args = parser.parse_args()
    if args.from_json:
        rendered = render_results(args.from_json, table)
    else:
        results = measure()
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        rendered = table(results)
    if args.doc:
        write_doc_block(args.doc, rendered, Path(__file__).name)
    else:
        print(rendered)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
