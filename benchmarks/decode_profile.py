"""Where a decode step's time goes: milliseconds per decode step of graph decoding
(`vlmrl.training.rollout.graph_decode`) on the model with Qwen3-VL-2B's shapes, bf16 or NF4, LoRA r16 on the
7 projections (as `gspo_step.py`), for several row counts and both decode attentions ("model":
transformers' SDPA with its `repeat_kv` copies; "grouped"), with the benchmark's prompts (the
project's synthetic 512 px images, each prompt repeated 4 times as TRL does) and TRL's sampling
(temperature 1, top-k 20, top-p 0.8), a static cache of 1408 slots (longest prompt + 1024). With
`--kernels`, the CUDA kernels of a few replayed decode steps, by total time (torch.profiler). Prints a table
and writes `--out` JSON; `--from-json FILE... --doc DOC` writes the kernel table of stored runs
into DOC (no GPU).

  PYTHONPATH=src python benchmarks/decode_profile.py --rows 16,32 --out /tmp/decode_profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gspo_configs  # the GSPO step benchmark's model and LoRA settings
from decode_tables import CALL_TOKENS, KERNEL_GROUPS, gap_table, kernel_table, replay_table
from doc_blocks import write_doc_block
from gspo_measure import copy_bandwidth, decode_weight_bytes, device_name, synced_timer
from gspo_worker import ROOT, prepare_train_set

from vlmrl.training.rollout.nf4_decode import Tiles

MODEL = gspo_configs.MODEL  # --model: another embedded shape
KV_CACHE_DTYPE = "auto"  # --kv-cache-dtype


def load(four_bit: bool):
    from vlmrl.models.loading import load_policy
    from vlmrl.params import LoraParams, ModelParams, load_params

    params = load_params(ROOT / "params.yaml")
    settings = ModelParams.from_params({**params.section("model"), "name": MODEL,
                                        "backend": "transformers", "load_in_4bit": four_bit,
                                        "dtype": "auto", "seed": 0})
    model, processor, _ = load_policy(settings, LoraParams(**gspo_configs.LORA), 0)
    return model.eval(), processor


def prompts(processor, train_set: Path, rows: int) -> dict:
    from datasets import load_from_disk

    from vlmrl.evaluation.evaluate import render_prompt

    dataset = load_from_disk(str(train_set))
    picked = [dataset[i] for i in range(rows // gspo_configs.NUM_GENERATIONS)]
    repeated = [row for row in picked for _ in range(gspo_configs.NUM_GENERATIONS)]
    processor.tokenizer.padding_side = "left"
    batch = processor(text=[render_prompt(processor, row) for row in repeated],
                      images=[row["image"] for row in repeated], return_tensors="pt",
                      padding=True)
    return {key: value.to("cuda") for key, value in batch.items()}


def config(model, new_tokens: int, cache_len: int, compiled: bool = False):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=20,
                            top_p=0.8, eos_token_id=-5, pad_token_id=0,
                            cache_implementation="static", max_cache_len=cache_len,
                            disable_compile=not compiled)


def ms_per_step(model, batch, attention: str, new_tokens: int, cache_len: int,
                nf4_kernel: bool, compiled: bool, gaps: bool = False) -> tuple[float, float, dict]:
    """Milliseconds per decode step, the peak GiB allocated while decoding, and the replays'
    times (with `gaps`, their `replay_gaps` too)."""
    from vlmrl.training.rollout.graph_decode import GraphDecoding

    decoding = GraphDecoding(model=model, original=model.generate, attention=attention,
                             nf4_kernel=nf4_kernel, kv_cache_dtype=KV_CACHE_DTYPE)
    decoding._decode(config(model, new_tokens, cache_len, compiled), batch)  # capture
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    decoding._decode(config(model, new_tokens, cache_len, compiled), batch)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30
    replays = {count: replay_ms(decoding, count) for count in (8, 64)}
    if gaps:
        replays["gaps"] = replay_gaps(decoding)
    del decoding
    return seconds * 1000 / new_tokens, peak, replays


def replay_ms(decoding, count: int) -> dict[str, float]:
    """Milliseconds per replay of the decode step's graph, `count` replays launched back to back:
    on the host (the launches alone, no synchronisation) and on the GPU (CUDA events around them
    all). A host time near the GPU's says the host, not the GPU, sets the step's pace."""
    (decoder,) = decoding.decoders.values()
    (graph,) = decoder.graphs.values()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    launched = time.perf_counter()
    for _ in range(count):
        graph.replay()
    host = time.perf_counter() - launched
    end.record()
    torch.cuda.synchronize()
    return {"host_ms": round(host * 1000 / count, 4),
            "gpu_ms": round(start.elapsed_time(end) / count, 4)}


def replay_gaps(decoding, count: int = 8) -> dict:
    """The GPU's idle time between the kernels of `count` replays of the decode step's graph,
    launched back to back (torch.profiler's kernel start and end times): per replay, in all and
    by transition (the kernel family before -> after, `kernel_family`). Whether the step's time
    outside its kernels lies inside the graph, kernel to kernel, or between replays."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    (decoder,) = decoding.decoders.values()
    (graph,) = decoder.graphs.values()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(count):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [(event.name, event.time_range.start, event.time_range.end)
               for event in prof.events() if event.device_type == DeviceType.CUDA]
    return gap_transitions(kernels, count)


def kernel_family(name: str) -> str:
    """A kernel's family in `replay_gaps`: the step's own kernels by their KERNEL_GROUPS (short
    names where those are long), inductor's by their prefix, others by name."""
    for group, prefixes in (*KERNEL_GROUPS, ("inductor", ("triton_",))):
        if name.startswith(prefixes):
            return SHORT_FAMILIES.get(group, group)
    return name.split("(")[0].split("<")[0][-48:]


SHORT_FAMILIES = {"NF4 projections": "NF4", "attention over the cache": "attention"}


def gap_transitions(kernels: list[tuple[str, float, float]], replays: int) -> dict:
    """`replay_gaps` of kernels (name, start and end in microseconds) from `replays` replays."""
    ordered = sorted(kernels, key=lambda kernel: kernel[1])
    by_transition: dict[str, list[float]] = {}
    for before, after in itertools.pairwise(ordered):
        key = f"{kernel_family(before[0])} -> {kernel_family(after[0])}"
        by_transition.setdefault(key, []).append(max(after[1] - before[2], 0.0))
    total = sum(sum(gaps) for gaps in by_transition.values())
    return {"replays": replays, "kernels_per_replay": len(ordered) / replays,
            "gap_us_per_replay": round(total / replays, 1),
            "transitions": sorted(({"transition": key, "us_per_replay": round(sum(gaps) / replays, 1),
                                    "per_replay": len(gaps) / replays,
                                    "mean_us": round(sum(gaps) / len(gaps), 3)}
                                   for key, gaps in by_transition.items()),
                                  key=lambda row: -row["us_per_replay"])}


def call_phases(model, batch, attention: str, new_tokens: int, cache_len: int, keep: bool,
                calls: int = 3) -> list[dict[str, float]]:
    """Seconds of consecutive generate calls (compiled step, NF4 kernel) and of their parts, each
    synchronised: the prefill, the first decode step (with `keep` off, as the "graph" mode
    trains, a new cache and a new capture each call), and the rest; what the calls hold beyond
    the decode steps' replays."""
    from vlmrl.training.rollout import graph_decode

    records: list[dict[str, float]] = []

    def record(phase: str, seconds: float) -> None:
        records[-1][phase] = round(seconds, 4)

    def timed(phase_of, function):
        return synced_timer(function, phase_of, record)

    class TimedDecoder(graph_decode.GraphDecoder):
        def prefill(self, *args):
            return timed(lambda: "prefill_s", super().prefill)(*args)

        def _run_step(self, span):
            first = None if "first_step_s" in records[-1] else "first_step_s"
            return timed(lambda: first, super()._run_step)(span)

    decoding = graph_decode.GraphDecoding(model=model, original=model.generate,
                                          attention=attention, nf4_kernel=True,
                                          kv_cache_dtype=KV_CACHE_DTYPE, keep=keep,
                                          decoder_class=TimedDecoder)
    for _ in range(calls):
        records.append({})
        timed(lambda: "call_s", decoding._decode)(config(model, new_tokens, cache_len, True),
                                                  batch)
    return records


def kernels(model, batch, attention: str, cache_len: int, nf4_kernel: bool, compiled: bool,
            top: int = 14) -> tuple[list[dict], dict]:
    """The `top` kernels of 8 decode steps replayed as the graph runs them (the prefill's profiled
    apart and subtracted), and all kernels' milliseconds and calls per step: what the step's time
    holds beyond its kernels is the gaps between them."""
    from torch.profiler import ProfilerActivity, profile

    from vlmrl.training.rollout.graph_decode import GraphDecoding

    decoding = GraphDecoding(model=model, original=model.generate, attention=attention,
                             nf4_kernel=nf4_kernel, kv_cache_dtype=KV_CACHE_DTYPE)
    decoding._decode(config(model, 4, cache_len, compiled), batch)  # capture
    totals: list[dict] = []
    for new_tokens in (1, 9):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decoding._decode(config(model, new_tokens, cache_len, compiled), batch)
            torch.cuda.synchronize()
        totals.append({e.key: (e.device_time_total, e.count) for e in prof.key_averages()
                       if e.device_time_total > 0})
    prefill, both = totals
    steps = {key: (time - prefill.get(key, (0, 0))[0], count - prefill.get(key, (0, 0))[1])
             for key, (time, count) in both.items()}
    ranked = sorted(steps.items(), key=lambda item: -item[1][0])[:top]
    every = {"ms_per_step": round(sum(time for time, _ in steps.values()) / 1000 / 8, 3),
             "calls_per_step": round(sum(count for _, count in steps.values()) / 8, 1)}
    return [{"kernel": key[:90], "ms_per_step": round(time / 1000 / 8, 3),
             "calls_per_step": round(count / 8, 1)} for key, (time, count) in ranked], every


# the K tile is one scale block; the first twelve: the main kernel's tile shapes, then the sum's
# tiles, programmatic dependent launch, the adapter's product in chunks, a register cap
SWEEP = [Tiles(128, 4, 3, 4), Tiles(128, 4, 3, 2), Tiles(128, 4, 3, 1), Tiles(256, 8, 3, 2),
         Tiles(256, 8, 3, 4), Tiles(256, 8, 4, 2), Tiles(64, 4, 3, 4), Tiles(64, 4, 3, 2),
         Tiles(128, 8, 3, 2), Tiles(128, 4, 4, 2), Tiles(64, 4, 4, 8), Tiles(256, 4, 3, 2),
         Tiles(128, 4, 3, 4, 32, 16), Tiles(128, 4, 3, 4, 64, 16), Tiles(128, 4, 3, 4, 16, 32),
         Tiles(256, 8, 3, 2, 32, 16), Tiles(128, pdl=True), Tiles(128, xa_chunk=16),
         Tiles(128, xa_chunk=16, max_registers=168), Tiles(128, pdl=True, xa_chunk=16)]


def field_value(name: str, kind: type, text: str) -> bool | float | int | str | None:
    """A `--tiles` value as the Tiles field's type takes it (booleans: 0/1/true/false; text,
    such as `xa_precision`, as it is)."""
    text = text.strip()
    if kind is str:
        return text
    if kind is bool:
        if text.lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"{name} is {text!r}, not 0 or 1")
        return text.lower() in ("1", "true")
    if text.lower() == "none" and type(None) in typing.get_args(kind):
        return None
    try:
        return float(text) if kind is float else int(text)
    except ValueError:
        raise ValueError(f"{name} is {text!r}, not a number") from None


def parse_tiles(text: str) -> list[Tiles]:
    """`--tiles`: `;` between tile shapes; in each, Tiles' fields in order, then any as
    name=value, `,` between them (e.g. `128,4,3,4;128,pdl=1,xa_chunk=16`)."""
    kinds = typing.get_type_hints(Tiles)
    names = list(kinds)
    shapes = []
    for shape in text.split(";"):
        items = [item.strip() for item in shape.split(",")]
        plain = [item for item in items if "=" not in item]
        try:
            if items[:len(plain)] != plain:
                raise ValueError("fields in order come before name=value")
            if len(plain) > len(names):
                raise ValueError(f"more than the {len(names)} fields of Tiles")
            values = {name: field_value(name, kinds[name], item)
                      for name, item in zip(names, plain)}
            for name, _, value in (item.partition("=") for item in items[len(plain):]):
                name = name.strip()
                if name not in kinds:
                    raise ValueError(f"Tiles has no field {name!r} (fields: {', '.join(names)})")
                if name in values:
                    raise ValueError(f"{name} is given twice")
                values[name] = field_value(name, kinds[name], value)
            shapes.append(Tiles(**values))
        except (ValueError, TypeError) as error:
            raise argparse.ArgumentTypeError(f"{shape!r}: {error}") from None
    return shapes


def kernel_times(call, calls: int = 20) -> dict:
    """Device microseconds per call: the NF4 kernel, the sum of splits, everything else."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times = {"nf4_us": 0.0, "sum_us": 0.0, "other_us": 0.0}
    for event in prof.key_averages():
        key = ("nf4_us" if "nf4_lora_matmul" in event.key else
               "sum_us" if "sum_splits" in event.key else "other_us")
        times[key] += event.device_time_total / calls
    return {key: round(value, 2) for key, value in times.items()}


def kernel_sweep(model, rows_list: list[int], bandwidth: float,
                 sweep: list[Tiles] = SWEEP) -> list[dict]:
    """Microseconds per `nf4_matmul` call (replayed in a CUDA graph of 20 calls) for each
    distinct projection shape, adapter on, per tile shape of `sweep`."""
    from vlmrl.training.rollout.nf4_decode import PackedNF4, nf4_matmul
    from vlmrl.training.rollout.nf4_projections import NF4Decode, _adapter

    nf4 = NF4Decode(model)
    shapes = {}
    for module, base in nf4.layers:
        shapes.setdefault(tuple(base.weight.quant_state.shape), (module, base))
    found = []
    for (out_features, in_features), (module, base) in shapes.items():
        weight, lora = PackedNF4.of(base), _adapter(module) or None
        for rows in rows_list:
            x = torch.randn(rows, in_features, dtype=torch.bfloat16, device="cuda")
            for tiles in sweep:
                nf4_matmul(x, weight, lora, tiles)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        nf4_matmul(x, weight, lora, tiles)
                graph.replay()
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(10):
                    graph.replay()
                torch.cuda.synchronize()
                us = (time.perf_counter() - started) * 1e6 / 200
                row = {"out": out_features, "in": in_features, "rows": rows,
                       "tiles": dataclasses.asdict(tiles), "us_per_call": round(us, 2),
                       **kernel_times(functools.partial(nf4_matmul, x, weight, lora, tiles)),
                       "bound_fraction": round(out_features * in_features / 2 / bandwidth
                                               / (us / 1e6), 3)}
                found.append(row)
                print(json.dumps(row), flush=True)
                del graph
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,32")
    parser.add_argument("--dtypes", default="bf16,nf4")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--cache-len", type=int, default=1408)
    parser.add_argument("--attentions", default="model,grouped")
    parser.add_argument("--sweep", action="store_true",
                        help="first time the NF4 kernel's tile shapes (SWEEP) per projection shape")
    parser.add_argument("--tiles", type=parse_tiles, default=SWEEP,
                        help="the tile shapes --sweep times: Tiles' fields in order and/or as "
                             "name=value, e.g. '128,4,3,4;128,pdl=1,xa_chunk=16'")
    parser.add_argument("--decode-tiles", type=parse_tiles, default=None,
                        help="one tile shape for the decode steps' NF4 kernel, as --tiles "
                             "(default: vlmrl.training.rollout.nf4_decode.TILES)")
    parser.add_argument("--nf4-kernels", default="off,on",
                        help="NF4 projections by bitsandbytes + PEFT (off) or vlmrl.training.rollout.nf4_decode (on)")
    parser.add_argument("--nf4-groups", default="on",
                        help="q/k/v and gate/up in one NF4 launch each (on, the shipped "
                             "nf4_projections.GROUPS) or one launch per projection (off); both: on,off")
    parser.add_argument("--kernels", action="store_true",
                        help="profile the kernels of the graph's decode steps at the most rows")
    parser.add_argument("--top", type=int, default=14,
                        help="with --kernels: how many kernels to keep, by total time")
    parser.add_argument("--gaps", action="store_true",
                        help="also trace 8 back-to-back replays of the step's graph: the GPU's "
                             "idle time between its kernels, by transition (replay_ms['gaps'])")
    parser.add_argument("--call-phases", action="store_true",
                        help="also time three generate calls of --call-tokens and their parts "
                             "(prefill, first step, the rest), with the decoder kept and not")
    parser.add_argument("--call-tokens", type=int, default=CALL_TOKENS)
    parser.add_argument("--compiles", default="off",
                        help="the decode step's forward pass eager (off) or under torch.compile (on)")
    parser.add_argument("--model", default=gspo_configs.MODEL,
                        help="the embedded shape (embedded:qwen3-vl-8b-shape: the 8B recipe's)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="train.kv_cache_dtype of the decoding measured")
    parser.add_argument("--out", type=Path, default=Path("decode_profile.json"))
    parser.add_argument("--from-json", type=Path, nargs="+", metavar="RESULTS",
                        help="measure nothing: write --table of these results into --doc")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--table", choices=("kernels", "replays", "gaps"), default="kernels",
                        help="with --from-json: the kernel table, the replays and calls, or the "
                             "idle time between a replay's kernels")
    args = parser.parse_args()
    if args.from_json:
        table = {"replays": replay_table, "gaps": gap_table}.get(args.table, kernel_table)
        write_doc_block(args.doc, table(args.from_json), Path(__file__).name, f":{args.table}")
        return 0
    global MODEL, KV_CACHE_DTYPE
    MODEL, KV_CACHE_DTYPE = args.model, args.kv_cache_dtype
    from vlmrl.training.rollout import nf4_decode, nf4_projections

    shipped_groups = nf4_projections.GROUPS
    if args.decode_tiles:
        if len(args.decode_tiles) != 1:
            parser.error("--decode-tiles: one tile shape")
        nf4_decode.TILES = args.decode_tiles[0]
    import os

    from vlmrl.models.embedded import ensure_embedded_model

    work = Path(tempfile.gettempdir()) / "gspo-bench"
    os.environ.setdefault("VLMRL_CACHE", str(work / "cache"))
    ensure_embedded_model(MODEL, seed=0, device="cuda")
    train_set = prepare_train_set(work, 64)
    bandwidth = copy_bandwidth()
    results: dict = {"device": device_name(), "bandwidth_bytes_per_s": bandwidth,
                     "model": MODEL, "kv_cache_dtype": KV_CACHE_DTYPE, "runs": [],
                     "command": " ".join(["benchmarks/decode_profile.py", *sys.argv[1:]]),
                     "decode_tiles": dataclasses.asdict(args.decode_tiles[0])
                     if args.decode_tiles else None}
    for dtype in args.dtypes.split(","):
        model, processor = load(dtype == "nf4")
        weights = decode_weight_bytes(model)
        if args.sweep and dtype == "nf4":
            results["kernel_sweep"] = kernel_sweep(
                model, [int(r) for r in args.rows.split(",")], bandwidth, args.tiles)
        for rows in [int(r) for r in args.rows.split(",")]:
            batch = prompts(processor, train_set, rows)
            for attention, kernel, compiled, groups in [
                    (a, k, c, g) for a in args.attentions.split(",")
                    for k in args.nf4_kernels.split(",") for c in args.compiles.split(",")
                    for g in args.nf4_groups.split(",")
                    if (dtype == "nf4" and k == "on") or (k == "off" and g == "on")]:
                nf4_projections.GROUPS = shipped_groups if groups == "on" else ()
                ms, peak, replays = ms_per_step(model, batch, attention, args.new_tokens,
                                                args.cache_len, kernel == "on", compiled == "on",
                                                args.gaps)
                run = {"dtype": dtype, "rows": rows, "attention": attention,
                       "nf4_kernel": kernel if dtype == "nf4" else None, "compiled": compiled,
                       "nf4_groups": groups if kernel == "on" else None,
                       "ms_per_step": round(ms, 3), "tokens_per_s": round(rows * 1000 / ms),
                       "peak_allocated_gib": round(peak, 3),
                       "weight_bytes": weights,
                       "bound_fraction": round(weights / bandwidth / (ms / 1000), 4),
                       "replay_ms": replays, "call_tokens": args.call_tokens}
                if args.kernels and rows == max(int(r) for r in args.rows.split(",")):
                    run["kernels"], run["all_kernels"] = kernels(
                        model, batch, attention, args.cache_len, kernel == "on", compiled == "on",
                        args.top)
                if args.call_phases and kernel == "on" and compiled == "on":
                    run["call_phases"] = {
                        "kept" if keep else "not kept": call_phases(
                            model, batch, attention, args.call_tokens,
                            max(args.cache_len, args.call_tokens), keep)
                        for keep in (True, False)}
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
                args.out.write_text(json.dumps(results, indent=1))
        nf4_projections.GROUPS = shipped_groups
        del model
        torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for run in results["runs"]:
        print(f"{run['dtype']:5} rows {run['rows']:3} {run['attention']:8} "
              f"kernel {run['nf4_kernel'] or '-':3} compiled {run['compiled']:3} "
              f"groups {run.get('nf4_groups') or '-':3} {run['ms_per_step']:7.2f} "
              f"ms/step {run['tokens_per_s']:6} tok/s  bound {100 * run['bound_fraction']:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
