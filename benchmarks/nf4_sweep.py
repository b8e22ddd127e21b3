"""Microseconds per NF4 projection call of the decode step (`vlmrl.training.rollout.nf4_decode`), per tile
shape, on the projections a decode step of the 2B and 8B shapes calls (q/k/v and gate/up as one
group each, o, down), 32 rows, nested block scales and a rank-16 adapter, as the GSPO profiles
run them.

Why not `decode_profile.py --sweep`: that one replays one weight, which the 50 MB L2 keeps after
the first call, so small projections time the cache; here each CUDA graph of calls cycles through
enough random copies of each projection to pass twice the L2, as the decode step reads a new
weight in every call. Every variant's output is checked against the first variant's on the same
copy (largest difference over the output's largest value), and the table adds up the
step's NF4 time per model (calls per layer x layers).

  PYTHONPATH=src python benchmarks/nf4_sweep.py --out benchmarks/results/nf4_sweep.json
  python benchmarks/nf4_sweep.py --from-json benchmarks/results/nf4_sweep.json --doc docs/benchmarks.md

A change to the kernel is timed against the kernel before it in the same device call by running
this script of the commit before, on that commit's library, into a second file, which
`--before FILE` puts first in the table (its variants named `before: ...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import read_results, write_doc_block

from vlmrl.training.rollout.nf4_decode import PackedNF4, Tiles

ROOT = Path(__file__).resolve().parents[1]
# (name, output widths of the group, input width) per decoder layer, and the layers
SHAPES = {"qwen3-vl-2b-shape": ([("qkv", (2048, 1024, 1024), 2048), ("o", (2048,), 2048),
                                 ("gate_up", (6144, 6144), 2048), ("down", (2048,), 6144)], 28),
          "qwen3-vl-8b-shape": ([("qkv", (4096, 1024, 1024), 4096), ("o", (4096,), 4096),
                                 ("gate_up", (12288, 12288), 4096), ("down", (4096,), 12288)],
                                36)}
ROWS, RANK, SCALING, L2_BYTES = 32, 16, 2.0, 50 * 2**20
# The first round (`nf4_sweep_1.json`): the adapter in tf32 and two blocks a step in columns of
# 128 came first; the second (`nf4_sweep.json`) varies around them.
WIDE = Tiles(block_n=128, k_blocks=2, xa_precision="tf32")
VARIANTS = {
    "before": Tiles(block_n=128),
    "xa tf32": Tiles(block_n=128, xa_precision="tf32"),
    "n128 x2 tf32": WIDE,
    "n128 x2 tf32 st2": dataclasses.replace(WIDE, stages=2),
    "n128 x2 tf32 pps2": dataclasses.replace(WIDE, programs_per_sm=2),
    "n128 x2 tf32 pps8": dataclasses.replace(WIDE, programs_per_sm=8),
    "n128 x2 tf32 regs168": dataclasses.replace(WIDE, max_registers=168),
    "n128 x2 tf32 pdl": dataclasses.replace(WIDE, pdl=True),
    "n256 x2 w8 tf32": dataclasses.replace(WIDE, block_n=256, warps=8),
    "n128 x1 tf32 pps8": Tiles(block_n=128, programs_per_sm=8, xa_precision="tf32"),
    "n64 x2 tf32": Tiles(block_n=64, k_blocks=2, xa_precision="tf32"),
    # the third round (`nf4_sweep_3.json`): eight warps on the shipped tile, and the `fused`
    # variants, which added the splits in the first launch (`Tiles.fused_sum` of commit 3f3186f,
    # reverted after this round timed it slower on every projection)
    "n128 x2 w8 tf32": dataclasses.replace(WIDE, warps=8),
    # the fourth round (`nf4_sweep_4.json`): x's rows in fp16 before the kernel (`fp16_rows`),
    # the column scales' power of two per split, and the adapter's x A^T on fp16 operands; the
    # kernel before them timed in the same call from that commit's library (`nf4_sweep_4_before`)
    "n128 x2 xa fp16": dataclasses.replace(WIDE, xa_precision="fp16"),
    # K in the lanes' order (`Tiles.lane_order`), timed in the fifth round (`nf4_sweep_5.json`)
    "n128 x2 xa fp16 lanes": dataclasses.replace(WIDE, xa_precision="fp16", lane_order=True),
}
# The sixth round (`nf4_sweep_6.json`): the shipped tiles with wider tiles of the second launch,
# which adds the splits (`sum_block_n` columns by `sum_rows` rows a program; the same sums in the
# same order, so the same bits), and with fewer or more splits (`programs_per_sm`).
SHIPPED = VARIANTS["n128 x2 xa fp16"]
VARIANTS |= {f"fp16 sum n{columns} r{rows}": dataclasses.replace(
    SHIPPED, sum_block_n=columns, sum_rows=rows)
    for columns in (16, 32, 64, 128) for rows in (16, 32)}
VARIANTS |= {f"fp16 pps{programs}": dataclasses.replace(SHIPPED, programs_per_sm=programs)
             for programs in (2, 8)}
# The partial sums in bfloat16 between the two launches (`Tiles.partials`), not timed yet.
VARIANTS["fp16 parts bf16"] = dataclasses.replace(SHIPPED, partials="bfloat16")


def random_group(widths: tuple[int, ...], in_features: int) -> tuple[list[PackedNF4], list]:
    """Random packed NF4 weights with nested block scales (as bitsandbytes' double quantization
    stores them) side by side, and an adapter each."""
    from vlmrl.training.rollout.nf4_decode import side_by_side

    weights, loras = [], []
    for width in widths:
        blocks = width * in_features // 64
        packed = torch.randint(0, 256, (width * in_features // 2, 1), dtype=torch.uint8,
                               device="cuda")
        codes = torch.randint(0, 256, (in_features // 64, width), dtype=torch.uint8,
                              device="cuda")
        code2 = torch.sort(torch.rand(256, device="cuda") * 2 - 1).values
        absmax2 = torch.rand(-(-blocks // 256), device="cuda") * 0.05
        weights.append(PackedNF4(packed, codes, width, in_features, 64, absmax2, code2, 0.03))
        loras.append((torch.randn(RANK, in_features, device="cuda") * 0.02,
                      torch.randn(width, RANK, device="cuda") * 0.02, SCALING))
    return side_by_side(weights), loras


def time_group(copies: list, x: torch.Tensor, tiles: Tiles, replays: int = 10) -> float:
    """Microseconds per call, from a CUDA graph that calls once per copy, replayed: the kernels
    on x as `fp16_rows` gives it, which the decode step computes in the kernel before them."""
    from vlmrl.training.rollout.nf4_decode import fp16_rows, nf4_rows_matmul

    x16, row_up = fp16_rows(x, tiles, copies[0][0][0].blocksize)
    for weights, loras in copies[:2]:
        nf4_rows_matmul(x16, row_up, weights, loras, tiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weights, loras in copies:
            nf4_rows_matmul(x16, row_up, weights, loras, tiles)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(copies))
    del graph
    return sorted(times)[len(times) // 2]


def measure(variants: dict[str, Tiles]) -> dict:
    from vlmrl.training.rollout.nf4_decode import nf4_group_matmul

    results = {"device": torch.cuda.get_device_name(0), "rows": ROWS, "rank": RANK,
               "variants": {name: dataclasses.asdict(tiles) for name, tiles in variants.items()},
               "runs": []}
    torch.manual_seed(0)
    for model, (groups, layers) in SHAPES.items():
        for name, widths, in_features in groups:
            weight_bytes = sum(widths) * in_features // 2
            count = max(4, min(48, -(-2 * L2_BYTES // weight_bytes)))
            copies = [random_group(widths, in_features) for _ in range(count)]
            x = torch.randn(ROWS, in_features, dtype=torch.bfloat16, device="cuda")
            reference = nf4_group_matmul(x, *copies[0], next(iter(variants.values()))).float()
            for variant, tiles in variants.items():
                got = nf4_group_matmul(x, *copies[0], tiles).float()
                difference = ((got - reference).abs().max() / reference.abs().max()).item()
                us = time_group(copies, x, tiles)
                run = {"model": model, "projection": name, "widths": list(widths),
                       "in": in_features, "layers": layers, "variant": variant,
                       "us_per_call": round(us, 2), "copies": count,
                       "gb_per_s": round(weight_bytes / us / 1e3, 1),
                       "difference_to_first": float(f"{difference:.3g}")}
                print(json.dumps(run), flush=True)
                results["runs"].append(run)
            del copies
            torch.cuda.empty_cache()
    return results


def table(results: dict) -> str:
    """Per model, projection and variant: microseconds per call; the last column the decode
    step's NF4 time (each projection once a layer)."""
    runs = results["runs"]
    variants = list(results["variants"])
    caption = (f"Written by `benchmarks/nf4_sweep.py`: {results['device']}, {results['rows']} "
               f"rows, adapter rank {results['rank']}, nested scales; microseconds per call (a "
               "CUDA graph cycling through copies of each projection past twice the L2); the "
               "step: each projection once a layer, all layers, in ms.")
    lines = [caption, ""]
    models = list(dict.fromkeys(run["model"] for run in runs))
    for model in models:
        mine = [run for run in runs if run["model"] == model]
        names = list(dict.fromkeys(run["projection"] for run in mine))
        lines += [f"| {model} | " + " | ".join(names) + " | NF4 ms a step | largest difference |",
                  "| --- |" + " ---: |" * (len(names) + 2)]
        for variant in variants:
            cells = {run["projection"]: run for run in mine if run["variant"] == variant}
            if len(cells) < len(names):
                continue
            step = sum(cells[name]["us_per_call"] * cells[name]["layers"] for name in names)
            worst = max(cells[name]["difference_to_first"] for name in names)
            lines.append(f"| `{variant}` | " + " | ".join(
                f"{cells[name]['us_per_call']:.1f}" for name in names)
                + f" | {step / 1000:.2f} | {worst:.1e} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def with_before(before: dict, results: dict) -> dict:
    """`results` with the runs of `before` (the sweep of the library before a change, same
    device call) first, their variants named `before: ...`; each file's largest difference is
    to its own first variant."""
    def renamed(name: str) -> str:
        return f"before: {name}"

    return {**results,
            "variants": {**{renamed(name): tiles for name, tiles in before["variants"].items()},
                         **results["variants"]},
            "runs": [{**run, "variant": renamed(run["variant"])} for run in before["runs"]]
            + results["runs"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="names of VARIANTS, comma separated")
    parser.add_argument("--out", type=Path, default=Path("nf4_sweep.json"))
    parser.add_argument("--from-json", type=Path, metavar="RESULTS")
    parser.add_argument("--before", type=Path, metavar="RESULTS",
                        help="with --from-json: a sweep of the library before, shown first")
    parser.add_argument("--doc", type=Path)
    parser.add_argument("--doc-block", default="", help="the block's name after the markers' "
                        "begin/end (`:begin-1`: --doc-block -1)")
    args = parser.parse_args()
    if args.from_json:
        results = read_results(args.from_json)
        if args.before:
            results = with_before(read_results(args.before), results)
    else:
        chosen = {name: VARIANTS[name] for name in args.variants.split(",")}
        results = measure(chosen)
        args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(table(results))
    if args.doc:
        write_doc_block(args.doc, table(results), "nf4_sweep", args.doc_block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
