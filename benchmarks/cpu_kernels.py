"""What the two CPU paths of `vlmrl` save, on the embedded tiny model's shapes (hidden 256,
Qwen3's 151,936-token vocabulary): where the model is this small, the work over the vocabulary
costs more than the model.

- sampling one decoding step of 64 rows: transformers' warpers (top-k 20, then a top-p sort of the
  whole vocabulary, `torch.multinomial` over all of it, a vocabulary-wide `where` for the
  suppressed tokens) against `vlmrl.models.sampling.TopKSampler`; the output layer's matmul beside
  them for scale;
- per-token log-probabilities and entropy of 800 completion tokens (a GSPO step's 32 completions):
  plain autograd over a log-softmax against `vlmrl.training.trainer.logprob_fallback`'s fused function, forward and
  backward.

    python benchmarks/cpu_kernels.py        # JSON: benchmarks/results/cpu_kernels.json
    python benchmarks/cpu_kernels.py --from-json benchmarks/results/cpu_kernels.json   # table only

The table replaces the block between this script's markers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from doc_blocks import render_results, write_doc_block
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlmrl.models.sampling import SamplingSettings, TopKSampler
from vlmrl.training.trainer.logprob_fallback import TorchChunkedLogProb, _autograd_outputs

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, ROWS, TOKENS = 151_936, 256, 64, 800
SUPPRESSED = (151652, 151653, 151654, 151655, 151656)  # Qwen's vision tokens


def median_ms(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up: allocator and thread pool
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 1)


def sampling_step(repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02
    hidden = torch.randn(ROWS, HIDDEN, generator=generator) * 16
    logits = hidden @ weight.T
    warpers = LogitsProcessorList([SuppressTokensLogitsProcessor(SUPPRESSED),
                                   TemperatureLogitsWarper(1.0), TopKLogitsWarper(20),
                                   TopPLogitsWarper(0.8)])
    sampler = TopKSampler(SamplingSettings(1.0, 20, 0.8, suppress=SUPPRESSED))
    ids = torch.zeros(ROWS, 1, dtype=torch.long)

    def transformers_step():
        probs = warpers(ids, logits.clone()).softmax(-1)
        return torch.multinomial(probs, 1)

    def vlmrl_step():
        return sampler(ids, logits.clone()).argmax(-1)  # generate's greedy pick

    return {"output_layer_matmul_ms": median_ms(lambda: hidden @ weight.T, repeats),
            "transformers_sampling_ms": median_ms(transformers_step, repeats),
            "vlmrl_sampling_ms": median_ms(vlmrl_step, repeats),
            "copy_of_the_logits_ms": median_ms(logits.clone, repeats)}


def log_prob_pass(repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02
    hidden = (torch.randn(TOKENS, HIDDEN, generator=generator) * 16).requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    outputs = ("log_probs", "entropy")
    results = {}
    for name, function in (("autograd", lambda: _autograd_outputs(
            hidden, weight, None, targets, 1.0, None, 1.0, outputs)),
                           ("fused", lambda: TorchChunkedLogProb.apply(
            hidden, weight, None, targets, 1.0, 256, None, 1.0, outputs))):
        forward, backward = [], []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            log_probs = function()[0]
            middle = time.perf_counter()
            log_probs.sum().backward()
            forward.append(middle - started)
            backward.append(time.perf_counter() - middle)
        with torch.no_grad():
            no_grad = median_ms(function, repeats)
        results[f"{name}_forward_ms"] = round(1000 * statistics.median(forward[1:]), 1)
        results[f"{name}_backward_ms"] = round(1000 * statistics.median(backward[1:]), 1)
        results[f"{name}_no_grad_ms"] = no_grad
    return results


def render(results: dict) -> str:
    s, lp = results["sampling"], results["log_probs"]
    return "\n".join([
        (f"Measured {results['date']} on {results['machine']}, torch {results['torch']}, "
         f"{results['threads']} threads; median of {results['repeats']}."),
        "",
        f"| one decoding step, {ROWS} rows | ms |",
        "| --- | ---: |",
        (f"| output layer matmul ({ROWS} x {HIDDEN} x {VOCAB:,}), for scale "
         f"| {s['output_layer_matmul_ms']} |"),
        ("| transformers: suppress, temperature, top-k 20, top-p 0.8, multinomial "
         f"| {s['transformers_sampling_ms']} |"),
        f"| `TopKSampler`, the same distribution | {s['vlmrl_sampling_ms']} |",
        "",
        (f"| log-probabilities + entropy of {TOKENS} tokens | forward ms | backward ms "
         "| no-grad ms |"),
        "| --- | ---: | ---: | ---: |",
        (f"| autograd over a log-softmax | {lp['autograd_forward_ms']} "
         f"| {lp['autograd_backward_ms']} | {lp['autograd_no_grad_ms']} |"),
        (f"| `vlmrl.training.trainer.logprob_fallback` fused | {lp['fused_forward_ms']} | {lp['fused_backward_ms']} "
         f"| {lp['fused_no_grad_ms']} |"),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu_kernels.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks.md")
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument("--from-json", type=Path, metavar="RESULTS",
                        help="measure nothing: write the table of a stored results file into --doc")
    args = parser.parse_args()
    if args.from_json is not None:
        write_doc_block(args.doc, render_results(args.from_json, render), Path(__file__).name)
        return
    results = {"date": time.strftime("%Y-%m-%d"),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "repeats": args.repeats, "sampling": sampling_step(args.repeats),
               "log_probs": log_prob_pass(args.repeats)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    table = render(results)
    if not args.no_doc:
        write_doc_block(args.doc, table, Path(__file__).name)
    print(table)


if __name__ == "__main__":
    main()
