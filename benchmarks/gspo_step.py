"""Seconds per GSPO optimizer step, generated tokens per second and peak GPU memory, per training
configuration, on a random-init model with Qwen3-VL-2B's real shapes (`embedded:qwen3-vl-2b-shape`)
and the project's own data (512 px synthetic charts, tables and geometry from vlmrl.data.synth through
vlmrl.data.prepare.prepare).

Every configuration does the same work per optimizer step: 16 completions of `--lengths` tokens
(4 prompts x 4 generations), LoRA r16/alpha16 on the language model's 7 projections, gradient
checkpointing. The reference batch shape is per_device_train_batch_size 8 x
gradient_accumulation_steps 2; the GPU profile trains the same 16 completions as 8 micro-batches
of 2. A random-init model almost never samples EOS (2 ids out of 151,936), so every completion
runs to the maximum length; the measured mean completion length is reported to show it.
Configurations (`CONFIGS`):

  unsloth_4bit        the seed notebooks' reference: Unsloth FastVisionModel in 4-bit, Unsloth's
                      patched GRPOTrainer, Hugging Face generate, steps_per_generation = GA
  transformers_bf16   transformers + PEFT in bf16, plain TRL GRPOTrainer, steps_per_generation = GA
  transformers_4bit   the same with bitsandbytes NF4 4-bit
  gpu_profile_*       candidates for the GPU profile: NF4, a static KV cache sized once
                      (max_cache_len), compiled decoding (torch.compile + CUDA graphs through
                      transformers' auto-compile, which TRL switches off), micro-batches of 2,
                      and a generation batch shape per candidate (see CONFIGS)
  gpu_profile         the candidate the README's GPU profile uses (GPU_PROFILE)
  gpu_profile_bf16    bf16 weights, static cache, compiled decoding, one generation of 32 rows
                      for two optimizer steps, reference batch shape
  gpu_profile_vllm    the same with TRL's vLLM colocate generation in place of HF generate; only
                      where vllm is installed (recorded as skipped elsewhere)

The trainer is built by the train_gspo stage's own code (vlmrl.training.gspo.make_trainer), so compiled
decoding and generation in chunks are switched on exactly as the stage does. TRL switches gradient
checkpointing off around generation (`unwrap_model_for_generation`), so generate keeps its KV
cache; every run still records whether transformers ever logged that it dropped the cache under
gradient checkpointing (`kv_cache_dropped_in_generation`), which would make every sampled token
ignore the prompt. Peak memory is recorded per phase: inside `generate`, and the rest (training,
scoring, old log-probabilities). Each phase of a step is timed too (`seconds_by_phase`, every call
in `phase_calls`: generation, old log-probabilities, the loss's forward, the backward, garbage
collection), and the docs table shows the first micro-batch after each generation apart.

`--model embedded:qwen3-vl-8b-shape` runs the same configurations on Qwen3-VL-8B's shape, to see
what fits a 24 GB GPU; such runs are keyed `config@length@qwen3-vl-8b-shape` and summarized under
`results_other_models`, apart from the 2B-shaped `results` the speed target is judged on.
`peak_device_gib` adds what the process holds beside PyTorch's pool (CUDA context, kernels).

Each run also records, per optimizer step (`per_step`, from TRL's log through
vlmrl.training.trainer.logs.step_log_rows), whether GSPO acted: reward and reward std, the share of groups
whose rewards all tie (`frac_reward_zero_std`; their advantage is 0), grad norm, and the clip
ratio (`clip_ratio_region_mean`, with its `_low_mean` and `_high_mean` parts). TRL logs the
reward fields only on steps that generate, and a clip ratio of 0 on on-policy steps. On the
random-init model every completion runs to the maximum length, so every reward of a group ties:
reward std 0 and grad norm 0 there are what this model gives, not a fault of the run.

With `--profile-training`, one more optimizer step follows the timed ones with its micro-batches
under torch.profiler (`training_kernels`: its kernels by device time; the timings leave it out):
the phase timers say how long forward and backward take, not which kernels take it. With
`--profile-host`, the first timed generation's input preparation runs under cProfile, the
generation itself left out (`host_profile`: its functions by cumulative seconds): what the
phase tables' host columns hold. That run's timings include the profiler's cost.
`--profile-training` also records, per profiled micro-batch, its wall seconds and the GPU's
busy seconds (`training_busy`): whether the training phases wait on the host. With
`--profile-training-host`, one more optimizer step after those runs its micro-batches under
cProfile (`training_host_profile`, the generation left out): which host work that is.

Each (configuration, length) runs in its own process (Unsloth patches torch and transformers on
import), results are merged into `--out` as they arrive (`runs`, raw; `results`, configuration ->
one entry per completion length), and a run that would not fit in `--budget-s` is skipped and
recorded as such.

Usage (on a GPU machine; tests/gpu/run_on_device.sh installs what is missing):
  PYTHONPATH=src python benchmarks/gspo_step.py --configs unsloth_4bit,gpu_profile \\
      --lengths 256 --warmup 2 --steps 4 --out benchmarks/results/gspo_step.json

Tables from stored results, anywhere (nothing measured, no GPU needed):
  python benchmarks/gspo_step.py --from-json RESULTS --doc-block NAME   # one file's full table
  python benchmarks/gspo_step.py --from-json A.json B.json ... --doc-block speed --readme README.md
      # the speed summary: each (model, tokens, configuration) from the first file that has it
  python benchmarks/gspo_step.py --merge CALL1.json CALL2.json ... --out RESULTS
      # several device calls' results in one file (each call records its command line)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from doc_blocks import render_results, replace_between

ROOT = Path(__file__).resolve().parents[1]
MODEL = "embedded:qwen3-vl-2b-shape"
PER_DEVICE_BATCH = 8
GRAD_ACCUM = 2
NUM_GENERATIONS = 4
LORA = {"r": 16, "alpha": 16, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"]}

REFERENCE_BATCH = {"per_device_train_batch_size": PER_DEVICE_BATCH,
                   "gradient_accumulation_steps": GRAD_ACCUM, "steps_per_generation": GRAD_ACCUM}


def profile_candidate(micro_batch: int, steps_per_generation: int,
                      rows: int | None = None) -> dict[str, Any]:
    """NF4 weights, compiled static-cache decoding, the same 16 completions per optimizer step
    trained in micro-batches of `micro_batch`, generation batches of micro_batch x
    steps_per_generation rows generated `rows` at a time (train.max_generation_rows)."""
    return {"backend": "transformers", "load_in_4bit": True,
            "per_device_train_batch_size": micro_batch,
            "gradient_accumulation_steps": PER_DEVICE_BATCH * GRAD_ACCUM // micro_batch,
            "steps_per_generation": steps_per_generation, "max_generation_rows": rows,
            "static_cache": True, "compile": True}


CONFIGS: dict[str, dict[str, Any]] = {
    "unsloth_4bit": {"backend": "unsloth", "load_in_4bit": True, **REFERENCE_BATCH,
                     "static_cache": False, "compile": False},
    "transformers_bf16": {"backend": "transformers", "load_in_4bit": False, **REFERENCE_BATCH,
                          "static_cache": False, "compile": False},
    "transformers_4bit": {"backend": "transformers", "load_in_4bit": True, **REFERENCE_BATCH,
                          "static_cache": False, "compile": False},
    # The GPU profile's candidates. A generation batch larger than the optimizer step's 16
    # completions serves two steps, the second off-policy (GSPO's ratio and clipping act);
    # one of 16 is on-policy; rows16 caps each generate call (and the static cache) at 16 rows.
    "gpu_profile_mb2_spg4": profile_candidate(2, 4),            # 2 x 8 rows per step
    "gpu_profile_mb2_spg8": profile_candidate(2, 8),            # 16 rows per step
    "gpu_profile_mb2_spg16_rows16": profile_candidate(2, 16, 16),  # 32 rows per 2 steps
    "gpu_profile_mb4_spg4": profile_candidate(4, 4),            # 16 rows per step
    "gpu_profile_mb4_spg8_rows16": profile_candidate(4, 8, 16),   # 32 rows per 2 steps
    "gpu_profile_mb8_spg4_rows16": profile_candidate(8, 4, 16),   # 32 rows per 2 steps
    # bf16 weights, compiled static-cache decoding, one generation of 32 rows for two optimizer
    # steps: the fastest measured, at twice the reference's memory.
    "gpu_profile_bf16": {"backend": "transformers", "load_in_4bit": False, **REFERENCE_BATCH,
                         "steps_per_generation": 2 * GRAD_ACCUM, "static_cache": True,
                         "compile": True},
}
# vLLM colocate (paged attention, continuous batching, CUDA graphs) in place of HF generate,
# bf16 weights, one generation for two optimizer steps. Runs only where vllm is installed: its
# wheels cannot be carried to the offline test GPU, so the run is recorded as skipped there.
CONFIGS["gpu_profile_vllm"] = {"backend": "transformers", "load_in_4bit": False, **REFERENCE_BATCH,
                               "steps_per_generation": 2 * GRAD_ACCUM, "static_cache": False,
                               "compile": False, "vllm": True}
VLLM_SETTINGS = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
                 "vllm_enable_sleep_mode": True}
# The decode step in one CUDA graph (train.graph_decoding, vlmrl.training.rollout.graph_decode):
# "graph" on the profile's batch shape (NF4, 16 rows per generate call: the memory profile) and in
# bf16 with all 32 rows of a generation in one call; "merged" (the adapter folded into bf16
# copies of the weights for decoding) with 32 rows: the speed profile. "compile": the decode
# step's forward pass under torch.compile inside the graph.
# "expandable_segments": train.expandable_segments (vlmrl.distributed.launch.use_expandable_segments).
CONFIGS["gpu_profile_graph"] = {**profile_candidate(8, 4, 16), "compile": True, "graph": "graph",
                                "expandable_segments": True}
CONFIGS["gpu_profile_graph_cached_segments"] = {**CONFIGS["gpu_profile_graph"],
                                                "expandable_segments": False}
CONFIGS["gpu_profile_graph_eager"] = {**CONFIGS["gpu_profile_graph"], "compile": False}
CONFIGS["gpu_profile_graph_bf16"] = {**profile_candidate(8, 4), "load_in_4bit": False,
                                     "compile": True, "graph": "graph"}
CONFIGS["gpu_profile_graph_merged"] = {**CONFIGS["gpu_profile_graph_bf16"], "graph": "merged"}
# All 32 rows of a generation in one call: the static cache twice as large in bf16 ("rows32"), or
# the same size in float8 (train.kv_cache_dtype fp8, vlmrl.training.rollout.decode_attention).
CONFIGS["gpu_profile_graph_rows32"] = {**CONFIGS["gpu_profile_graph"], "max_generation_rows": 32}
CONFIGS["gpu_profile_graph_fp8"] = {**CONFIGS["gpu_profile_graph_rows32"],
                                    "kv_cache_dtype": "fp8"}
# The float8 profile trained in micro-batches of 4 (the same 16 completions per optimizer step, one
# generation of 32 rows for two steps): the checkpointed activations of half the rows, for the 8B
# shape's peak.
CONFIGS["gpu_profile_graph_fp8_mb4"] = {**CONFIGS["gpu_profile_graph_fp8"],
                                        "per_device_train_batch_size": 4,
                                        "gradient_accumulation_steps": 4,
                                        "steps_per_generation": 8}
# The float8 profiles with the training forward's rows rolled, causal SDPA without a padding mask
# (train.training_attention rolled, vlmrl.training.trainer.attention).
CONFIGS["gpu_profile_graph_fp8_rolled"] = {**CONFIGS["gpu_profile_graph_fp8"],
                                           "training_attention": "rolled"}
CONFIGS["gpu_profile_graph_fp8_mb4_rolled"] = {**CONFIGS["gpu_profile_graph_fp8_mb4"],
                                               "training_attention": "rolled"}
# The float8 profiles with the text decoder layers compiled for training (train.compile_layers,
# vlmrl.training.trainer.compiled_layers); with the rows rolled too, each layer is still one compiled graph (the
# rows' runs come from the mask function).
for _name in ("gpu_profile_graph_fp8", "gpu_profile_graph_fp8_mb4", "gpu_profile_graph_fp8_rolled",
              "gpu_profile_graph_fp8_mb4_rolled"):
    CONFIGS[f"{_name}_compiled"] = {**CONFIGS[_name], "compile_layers": True}
# A generation of 48 rows for three optimizer steps, all in one call (the 8B shape's peak leaves
# room for the larger cache): the decode step reads each weight once for half as many rows again.
CONFIGS["gpu_profile_graph_fp8_mb4_rows48_rolled_compiled"] = {
    **CONFIGS["gpu_profile_graph_fp8_mb4_rolled_compiled"], "steps_per_generation": 12,
    "max_generation_rows": 48}
# The same with the NF4 decode kernel's tiles before the wide kernel (one scale block a K step,
# the adapter's x A^T in float32 on CUDA cores): one device call measures the kernel's change.
for _name in ("gpu_profile_graph_fp8_compiled", "gpu_profile_graph_fp8_mb4_compiled"):
    CONFIGS[f"{_name}_narrow"] = {**CONFIGS[_name], "decode_tiles": {"block_n": 128}}
# The recipes' profiles with one change each, timed beside the recipe in one device call:
WIDE_TILES = {"block_n": 128, "k_blocks": 2, "xa_precision": "fp16"}  # TILES but for `partials`
RECIPE_VARIANTS = {
    # each K step of the NF4 kernel in the tensor cores' lane order (`Tiles.lane_order`: a lane's
    # packed bytes load 16 at a time), on the tiles shipped when it was timed
    "lanes": {"decode_tiles": {**WIDE_TILES, "lane_order": True, "partials": "float32"}},
    # the NF4 kernel's partial sums between its two launches in bfloat16 (`Tiles.partials`; the
    # shipped tiles since it was timed) and in float32 (the tiles before)
    "parts_bf16": {"decode_tiles": {**WIDE_TILES, "partials": "bfloat16"}},
    "parts_float32": {"decode_tiles": {**WIDE_TILES, "partials": "float32"}},
    # each image through the vision tower once a generation (train.keep_image_features,
    # vlmrl.models.image_features)
    "images": {"keep_image_features": True},
    # reentrant gradient checkpointing (train.grpo.gradient_checkpointing_kwargs): a layer's
    # first forward without autograd, no saved-tensor hooks on the host
    "reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
    # the compiled layers' NF4 projections through vlmrl.training.trainer.nf4_linear
    # (`train.nf4_linears`), with reentrant checkpointing and without
    "nf4_linears": {"nf4_linears": True},
    "reentrant_nf4_linears": {"gradient_checkpointing_kwargs": {"use_reentrant": True},
                              "nf4_linears": True},
}
for _name in ("gpu_profile_graph_fp8_rolled_compiled", "gpu_profile_graph_fp8_mb4_rolled_compiled"):
    for _suffix, _change in RECIPE_VARIANTS.items():
        CONFIGS[f"{_name}_{_suffix}"] = {**CONFIGS[_name], **_change}
RECIPE_2B_PROFILE = "gpu_profile_graph_fp8_rolled_compiled_images"  # recipes/mathvista-qwen3-vl-2b.yaml's
RECIPE_8B_PROFILE = "gpu_profile_graph_fp8_mb4_rolled_compiled_images"  # recipes/mathvista-qwen3-vl-8b.yaml's
# The float8 profile as it stood before issue 41 (the NF4 kernel's tree decode and float32
# block scales, old log-probs for every row): the same knobs run on the library exported from
# that commit (`--baseline-src`), so one device call measures it beside the new one.
CONFIGS["gpu_profile_graph_fp8_before"] = {**CONFIGS["gpu_profile_graph_fp8"], "library": "baseline"}
BASELINE_COMMIT = "f4681fd"
GPU_PROFILE = "gpu_profile_mb8_spg4_rows16"
CONFIGS["gpu_profile"] = CONFIGS[GPU_PROFILE]
for _name, _knobs in CONFIGS.items():  # equal work: 16 completions per optimizer step
    assert (_knobs["per_device_train_batch_size"] * _knobs["gradient_accumulation_steps"]
            == PER_DEVICE_BATCH * GRAD_ACCUM), _name

KV_DROPPED_MESSAGE = "Caching is incompatible with gradient checkpointing"
# TRL's per-step log keys (flattened) that show whether an optimizer step moved the policy.
STEP_FIELDS = ("reward", "reward_std", "frac_reward_zero_std", "grad_norm",
               "clip_ratio_region_mean", "clip_ratio_low_mean", "clip_ratio_high_mean",
               "completions_mean_length")


# ------------------------------------------------------------------ shared setup (parent)

def prepare_train_set(out_dir: Path, size: int, image_size: int = 512) -> Path:
    """The project's synthetic set through prepare_data's own functions, saved like the stage."""
    from vlmrl.data.prepare import load_raw_records, prepare, to_dataset
    from vlmrl.params import DataParams

    target = out_dir / f"train-{size}-{image_size}"
    if (target / "dataset_info.json").is_file():
        return target
    settings = DataParams(synthetic_size=size, eval_size=4, image_size=image_size)
    prepared = prepare(load_raw_records(settings), settings)
    to_dataset(prepared.train).save_to_disk(str(target))
    return target


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "unsloth",
                 "unsloth_zoo", "datasets", "triton"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "missing"
    return found


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"


# ------------------------------------------------------------------ roofline

def decode_steps_of(completion_ids: list, knobs: dict[str, Any]) -> int:
    """Decode steps one generation batch took: its longest completion per generate call, times
    the calls it was split into (train.max_generation_rows)."""
    rows = knobs.get("max_generation_rows") or len(completion_ids) or 1
    calls = -(-len(completion_ids) // rows)
    return calls * max((len(ids) for ids in completion_ids), default=0)


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step must read: every language-model parameter once (NF4
    weights as packed bytes plus their quantization scales; LoRA included), not the vision tower
    (prefill only), and of an untied input embedding only the rows looked up (left out)."""
    seen: set[int] = set()
    total = 0
    for name, param in model.named_parameters():
        if ".visual." in f".{name}." or param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        total += param.numel() * param.element_size()
        state = getattr(param, "quant_state", None)
        while state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
            state = getattr(state, "state2", None)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    if output is not None and embedding.weight.data_ptr() != output.weight.data_ptr():
        total -= embedding.weight.numel() * embedding.weight.element_size()
    return total


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float | None:
    """Device memory bandwidth in bytes/s, measured by a device-to-device copy of random bytes
    (bytes read + bytes written over the median time of `repeats` copies)."""
    import torch

    if not torch.cuda.is_available():
        return None
    count = int(gib * 2**30)
    source = torch.randint(0, 256, (count,), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del source, target
    torch.cuda.empty_cache()
    return 2 * count / sorted(times)[len(times) // 2]


def bandwidth_fraction(run: dict[str, Any], bandwidth: float | None) -> float | None:
    """Decode steps per second over the weights' bound (bandwidth / weight bytes per step)."""
    steps, weights = run.get("decode_steps_per_second"), run.get("decode_weight_bytes")
    if not (steps and weights and bandwidth):
        return None
    return steps * weights / bandwidth


# ------------------------------------------------------------------ one run (worker)

def max_prompt_tokens(dataset, processor) -> int:
    """The longest prompt (chat template + image tokens) in the set."""
    from vlmrl.evaluation.evaluate import render_prompt

    longest = 0
    for row in dataset:
        text = render_prompt(processor, row)
        inputs = processor(text=[text], images=[row["image"]], return_tensors="pt")
        longest = max(longest, int(inputs["input_ids"].shape[1]))
    return longest


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synced_timer(original, phase_of, record):
    """`original`, timed with the device synchronised around it: `record(phase, seconds)` for
    each call whose `phase_of()` is not None (benchmarks/scaling.py times its phases the same)."""
    def call(*args, **kwargs):
        phase = phase_of()
        if phase is None:
            return original(*args, **kwargs)
        _sync()
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _sync()
            record(phase, time.perf_counter() - started)
    return call


def _peak_gib(kind: str) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return round(getattr(torch.cuda, f"max_memory_{kind}")() / 2**30, 2)


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def device_used_bytes() -> int | None:
    """Bytes in use on the device by every process (what nvidia-smi shows)."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def _non_pytorch_gib(others_bytes: int) -> float | None:
    """What this process holds on the device beside PyTorch's pool (CUDA context, cuBLAS
    workspaces, compiled kernels): a 24 GB card must hold this plus the peak reserved pool.
    `others_bytes` is what other processes (the driver process among them) held before it."""
    import torch

    used = device_used_bytes()
    if used is None:
        return None
    return round((used - others_bytes - torch.cuda.memory_reserved()) / 2**30, 2)


def max_cache_len(prompt_tokens: int, completion_tokens: int) -> int:
    return (prompt_tokens + completion_tokens + 63) // 64 * 64


class MemoryPeaks:
    """Peak GPU memory per phase (generation, the rest of training): the peak counters are read
    and reset at each boundary."""

    def __init__(self) -> None:
        self.peaks: dict[str, dict[str, int]] = {}

    def close(self, phase: str) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        seen = self.peaks.setdefault(phase, {"allocated": 0, "reserved": 0})
        for kind in seen:
            seen[kind] = max(seen[kind], getattr(torch.cuda, f"max_memory_{kind}")())
        torch.cuda.reset_peak_memory_stats()

    def by_phase(self, kind: str) -> dict[str, float]:
        return {phase: round(seen[kind] / 2**30, 2) for phase, seen in self.peaks.items()}

    def overall(self, kind: str) -> float | None:
        values = self.by_phase(kind).values()
        return max(values) if values else None


def per_step_fields(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per optimizer step (TRL logs `loss` on each) with the STEP_FIELDS it logged;
    a field TRL did not log on that step is left out."""
    from vlmrl.training.trainer.logs import step_log_rows

    return [{"step": row["step"], **{key: row[key] for key in STEP_FIELDS if key in row}}
            for row in step_log_rows(log_history) if "loss" in row]


# Trainer methods timed per optimizer step (nested: training_step holds prepare_inputs, which
# holds the prompts' processing, generation, rewards and the old log-probabilities).
PHASES = {"training_step": "training_step", "_prepare_inputs": "prepare_inputs",
          "_tokenize_prompts": "prompts", "_calculate_rewards": "rewards",
          "compute_loss": "loss"}


def time_phases(trainer) -> dict[str, list[tuple[int, float]]]:
    """Wraps PHASES' methods, the backward pass and the no-grad log-probability passes
    (`old_logps`) with a timer, and times Python's garbage collections (`gc`); returns phase ->
    [(optimizer step, seconds) per call], filled as the trainer runs."""
    import gc

    import torch

    calls: dict[str, list[tuple[int, float]]] = {}

    def record(phase: str, seconds: float) -> None:
        calls.setdefault(phase, []).append((trainer.state.global_step, seconds))

    def timed(original, phase_of):
        return synced_timer(original, phase_of, record)

    for method, phase in PHASES.items():
        setattr(trainer, method, timed(getattr(trainer, method), lambda phase=phase: phase))
    trainer.accelerator.backward = timed(trainer.accelerator.backward, lambda: "backward")
    logps = "_get_per_token_logps_and_entropies"
    setattr(trainer, logps, timed(getattr(trainer, logps),
                                  lambda: None if torch.is_grad_enabled() else "old_logps"))
    collecting: list[float] = []

    def on_gc(stage: str, info: dict) -> None:
        if stage == "start":
            collecting.append(time.perf_counter())
        elif collecting:
            record("gc", time.perf_counter() - collecting.pop())

    gc.callbacks.append(on_gc)
    return calls


def phase_means(calls: dict[str, list[tuple[int, float]]], warmup: int, timed_steps: int
                ) -> dict[str, float]:
    """Seconds per timed optimizer step spent in each phase."""
    timed = range(warmup, warmup + timed_steps)
    return {phase: round(sum(t for step, t in found if step in timed) / timed_steps, 3)
            for phase, found in calls.items()} if timed_steps else {}


def profile_training(trainer, step: int, top: int = 25) -> tuple[list[dict], list[dict]]:
    """Wraps the trainer's `training_step` so that the micro-batches of optimizer step `step` run
    under torch.profiler; returns the lists it fills: that step's `top` kernels by total device
    time (CPU operators by their own time where there is no GPU), and each micro-batch's
    `micro_batch_busy` (empty without a GPU): where a training step's time goes, which the phase
    timers cannot say."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    totals: dict[str, list[float]] = {}
    kernels: list[dict] = []
    busy: list[dict] = []

    def profiled(original, *args, **kwargs):
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            result = original(*args, **kwargs)
            _sync()
        busy.append(micro_batch_busy(prof, time.perf_counter() - started) if cuda else {})
        for event in prof.key_averages():
            spent = event.device_time_total if cuda else event.self_cpu_time_total
            if spent > 0:
                total = totals.setdefault(event.key, [0.0, 0])
                total[0] += spent
                total[1] += event.count
        ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
        kernels[:] = [{"kernel": key[:90], "ms_per_step": round(spent / 1000, 3),
                       "calls_per_step": int(count)} for key, (spent, count) in ranked]
        return result

    run_step_micro_batches(trainer, step, profiled)
    return kernels, busy


def run_step_micro_batches(trainer, step: int, run) -> None:
    """Wraps `trainer.training_step`: the micro-batches of optimizer step `step` go through
    `run(original, *args, **kwargs)`, the device synchronised first; the others run as they
    are."""
    original = trainer.training_step

    def training_step(*args, **kwargs):
        if trainer.state.global_step != step:
            return original(*args, **kwargs)
        _sync()
        return run(original, *args, **kwargs)

    trainer.training_step = training_step


def micro_batch_busy(prof, wall_seconds: float) -> dict:
    """How much of one profiled micro-batch's wall time (`wall_s`, the device synchronised at
    both ends) the GPU spent running kernels (`gpu_busy_s`, the union of the kernels' intervals,
    so overlapping streams count once): below the wall time, the GPU waited on the host."""
    from torch.autograd import DeviceType

    spans = sorted((event.time_range.start, event.time_range.end) for event in prof.events()
                   if event.device_type == DeviceType.CUDA)
    return {"wall_s": round(wall_seconds, 4), "kernels": len(spans),
            "gpu_busy_s": round(union_length(spans) / 1e6, 4)}


def union_length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals, sorted by start."""
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class TrainingHostProfile:
    """cProfile over the micro-batches (`training_step` calls) of optimizer step `step`, with
    its generation left out (`paused`, as HostProfile's): which host work the training
    micro-batches wait on where `micro_batch_busy` says the GPU idles. `result()`: the step's
    micro-batches' wall seconds without the generation, and the `top` functions by own seconds
    and by cumulative seconds."""

    def __init__(self, trainer, step: int, top: int = 40) -> None:
        self.profiler, self.wall_s, self.active = None, 0.0, False
        self.calls, self.top = 0, top
        run_step_micro_batches(trainer, step, self.profiled)

    def profiled(self, original, *args, **kwargs):
        import cProfile

        started = time.perf_counter()
        self.profiler = self.profiler or cProfile.Profile()
        self.profiler.enable()
        self.active = True
        try:
            return original(*args, **kwargs)
        finally:
            _sync()
            self.profiler.disable()
            self.active = False
            self.wall_s += time.perf_counter() - started
            self.calls += 1

    @contextlib.contextmanager
    def paused(self):
        profiling = self.profiler is not None and self.active
        if profiling:
            self.profiler.disable()
        started = time.perf_counter()
        try:
            yield
        finally:
            if profiling:
                self.wall_s -= time.perf_counter() - started
                self.profiler.enable()

    def result(self) -> dict:
        if self.profiler is None:
            return {}
        rows = profiled_functions(self.profiler)
        by_own = sorted(rows, key=lambda row: -row["own_s"])[:self.top]
        by_cumulative = sorted(rows, key=lambda row: -row["cumulative_s"])[:self.top]
        return {"micro_batches": self.calls, "wall_s": round(self.wall_s, 3),
                "by_own": by_own, "by_cumulative": by_cumulative}


class HostProfile:
    """cProfile over the first `_prepare_inputs` call from optimizer step `first_step` on that
    generates, with the generation itself left out (`paused`): which host work fills the phase
    tables' "other input work" and "prompts" columns, which the phase timers cannot split.
    `functions`: the `top` functions by cumulative seconds."""

    def __init__(self, trainer, first_step: int, top: int = 40) -> None:
        self.profiler, self.functions, self.generated = None, [], False
        original = trainer._prepare_inputs

        def prepare_inputs(*args, **kwargs):
            if trainer.state.global_step < first_step or self.functions:
                return original(*args, **kwargs)
            import cProfile

            self.profiler, self.generated = cProfile.Profile(), False
            self.profiler.enable()
            try:
                return original(*args, **kwargs)
            finally:
                self.profiler.disable()
                if self.generated:
                    self.functions[:] = self.ranked(top)
                self.profiler = None

        trainer._prepare_inputs = prepare_inputs

    @contextlib.contextmanager
    def paused(self):
        profiler = self.profiler
        if profiler is not None:
            self.generated = True
            profiler.disable()
        try:
            yield
        finally:
            if profiler is not None:
                profiler.enable()

    def ranked(self, top: int) -> list[dict]:
        return sorted(profiled_functions(self.profiler),
                      key=lambda row: -row["cumulative_s"])[:top]


def profiled_functions(profiler) -> list[dict]:
    """Every function a cProfile profiler saw: file:line(name), calls, cumulative and own
    seconds."""
    import pstats

    return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls,
             "cumulative_s": round(cumulative, 4), "own_s": round(own, 4)}
            for (file, line, name), (_, calls, own, cumulative, _)
            in pstats.Stats(profiler).stats.items()]


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's counts of device allocations, frees and retries."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ("num_alloc_retries", "num_device_alloc",
                                                "num_device_free", "num_sync_all_streams")}


class _KVDropDetector(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        if KV_DROPPED_MESSAGE in record.getMessage():
            self.seen = True


def worker(config_name: str, length: int, warmup: int, steps: int, train_set: Path,
           model_name: str, seed: int, partial: Path | None = None,
           others_bytes: int = 0, profile: bool = False,
           profile_host: bool = False, profile_training_host: bool = False) -> dict[str, Any]:
    knobs = CONFIGS[config_name]
    if knobs.get("vllm"):
        from vlmrl.training.gspo import vllm_installed

        if not vllm_installed():
            return {"config": config_name, "completion_length": length,
                    "error": "skipped: vllm is not installed"}
    if knobs["backend"] == "unsloth":
        import unsloth  # noqa: F401  (before trl and transformers, as the notebooks do)
    from datasets import load_from_disk
    from transformers import TrainerCallback

    from vlmrl.distributed.launch import use_expandable_segments
    from vlmrl.models.loading import load_policy
    from vlmrl.params import LoraParams, ModelParams, load_params
    from vlmrl.rewards.functions import build_rewards
    from vlmrl.training.rollout.generation import rollout_class
    from vlmrl.training.gspo import build_grpo_config, make_trainer

    # before anything initialises CUDA (building the GRPO config does): torch reads it then
    use_expandable_segments(knobs.get("expandable_segments", False))
    detector = _KVDropDetector()
    logging.getLogger("transformers").addHandler(detector)

    params = load_params(library_params())
    settings = ModelParams.from_params({**params.section("model"), "name": model_name,
                                        "backend": knobs["backend"],
                                        "load_in_4bit": knobs["load_in_4bit"], "dtype": "auto",
                                        "seed": seed})
    grpo = dict(params.train.grpo)
    batch = {key: knobs[key] for key in REFERENCE_BATCH}
    host_step = warmup + steps + int(profile)  # after the timed and the profiled steps
    grpo.update(max_steps=host_step + int(profile_training_host), **batch, num_generations=NUM_GENERATIONS, max_completion_length=length,
                gradient_checkpointing=True, top_p=0.8,  # as every row was measured
                **({"gradient_checkpointing_kwargs": knobs["gradient_checkpointing_kwargs"]}
                   if "gradient_checkpointing_kwargs" in knobs else {}),
                log_completions=False, logging_steps=1,
                report_to="none", seed=seed, **(VLLM_SETTINGS if knobs.get("vllm") else {}))
    reward_funcs, reward_weights = build_rewards(params.rewards.weights, params.rewards.options)
    out_dir = Path(tempfile.mkdtemp(prefix="gspo-bench-"))
    config = build_grpo_config(grpo, output_dir=out_dir, save_steps=10**6,
                               reward_weights=reward_weights, model_settings=settings)
    dataset = load_from_disk(str(train_set))

    _reset_peak()
    load_started = time.perf_counter()
    model, processor, backend = load_policy(settings, LoraParams(**LORA), config.seed,
                                            model_class=rollout_class)
    load_seconds = time.perf_counter() - load_started
    prompt_tokens = max_prompt_tokens(dataset, processor)
    # The train_gspo stage's own switches: train.grpo.cache_implementation and generation_kwargs
    # (max_cache_len, disable_compile), train.max_generation_rows; see make_trainer.
    if knobs["static_cache"]:
        config.cache_implementation = "static"
        # One cache for every call: sized for the longest prompt, so no reallocation/recompile.
        config.generation_kwargs = {**(config.generation_kwargs or {}),
                                    "max_cache_len": max_cache_len(prompt_tokens, length)}
    if knobs["compile"]:
        config.generation_kwargs = {**(config.generation_kwargs or {}), "disable_compile": False}

    step_times: list[float] = []
    generations: list[dict[str, Any]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _sync()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            step_times.append(time.perf_counter() - self.started)
            if partial is not None:  # what a run that is killed still leaves behind
                partial.write_text(json.dumps({
                    "step_seconds": [round(t, 3) for t in step_times],
                    "generation_calls": generations, "load_seconds": round(load_seconds, 1),
                    "peak_allocated_gib": _peak_gib("allocated"),
                    "peak_reserved_gib": _peak_gib("reserved")}))

    if "decode_tiles" in knobs:  # the NF4 decode kernel's tiles of an earlier commit
        from vlmrl.training.rollout import nf4_decode

        nf4_decode.TILES = nf4_decode.Tiles(**knobs["decode_tiles"])
    trainer = make_trainer(model, processor, config, dataset, reward_funcs,
                           generation_rows=knobs.get("max_generation_rows"), callbacks=[Timer()],
                           graph_decoding=knobs.get("graph", "eager"),
                           kv_cache_dtype=knobs.get("kv_cache_dtype", "auto"),
                           **{key: knobs[key] for key in ("training_attention", "compile_layers",
                                                          "nf4_linears", "keep_image_features")
                              if key in knobs})
    phase_seconds = time_phases(trainer)
    training_kernels, training_busy = (profile_training(trainer, warmup + steps) if profile
                                       else (None, None))
    host = HostProfile(trainer, warmup) if profile_host else None
    training_host = TrainingHostProfile(trainer, host_step) if profile_training_host else None
    peaks = MemoryPeaks()
    wrapped = hasattr(trainer, "_generate_single_turn")
    if wrapped:
        original = trainer._generate_single_turn

        def generate_single_turn(*args, **kwargs):
            _sync()
            peaks.close("training")
            started = time.perf_counter()
            with contextlib.ExitStack() as pauses:
                for profiler in (host, training_host):
                    if profiler is not None:
                        pauses.enter_context(profiler.paused())
                completion_ids, logprobs = original(*args, **kwargs)
                _sync()
            peaks.close("generation")
            generations.append({"step": trainer.state.global_step,
                                "seconds": time.perf_counter() - started,
                                "completions": len(completion_ids),
                                "tokens": sum(len(ids) for ids in completion_ids),
                                "decode_steps": decode_steps_of(completion_ids, knobs)})
            return completion_ids, logprobs

        trainer._generate_single_turn = generate_single_turn

    _reset_peak()
    trainer.train()
    peaks.close("training")
    peak_allocated, peak_reserved = peaks.overall("allocated"), peaks.overall("reserved")
    non_pytorch = _non_pytorch_gib(others_bytes)

    timed = step_times[warmup:warmup + steps]  # not the profiled step after them
    timed_generations = [g for g in generations if warmup <= g["step"] < warmup + steps]
    tokens = sum(g["tokens"] for g in timed_generations)
    completions = sum(g["completions"] for g in timed_generations)
    if not wrapped:  # fall back to the trainer's own log of mean completion length
        lengths = [e["completions/mean_length"] for e in trainer.state.log_history
                   if "completions/mean_length" in e][warmup:warmup + steps]
        per_step = knobs["per_device_train_batch_size"] * knobs["gradient_accumulation_steps"]
        completions = per_step * len(lengths)
        tokens = sum(lengths) * per_step
    seconds = sum(timed)
    generation_seconds = sum(g["seconds"] for g in timed_generations)
    weight_bytes = decode_weight_bytes(model)
    decode_steps = sum(g.get("decode_steps", 0) for g in timed_generations)
    return {
        "decode_weight_bytes": weight_bytes,
        "decode_steps_per_second": (decode_steps / generation_seconds
                                    if generation_seconds and decode_steps else None),
        "config": config_name,
        "completion_length": length,
        "backend": backend,
        "trainer_class": type(trainer).__name__,
        "seconds_per_step": seconds / len(timed) if timed else None,
        "step_seconds": [round(t, 3) for t in step_times],
        "generated_tokens_per_step": tokens / len(timed) if timed else None,
        "generated_tokens_per_second": tokens / seconds if seconds else None,
        "generation_only_tokens_per_second": (tokens / generation_seconds
                                              if generation_seconds else None),
        "generation_share": generation_seconds / seconds if seconds and wrapped else None,
        "seconds_by_phase": {**phase_means(phase_seconds, warmup, len(timed)),
                             "generation": round(generation_seconds / len(timed), 3)
                             if timed else None},
        "phase_calls": {phase: [[step, round(t, 3)] for step, t in found]
                        for phase, found in phase_seconds.items()},
        "allocator": allocator_counts(),
        "mean_completion_length": tokens / completions if completions else None,
        "peak_allocated_gib": peak_allocated,
        "peak_reserved_gib": peak_reserved,
        "non_pytorch_gib": non_pytorch,
        "peak_device_gib": (round(peak_reserved + non_pytorch, 2)
                            if peak_reserved is not None and non_pytorch is not None else None),
        "peak_allocated_gib_by_phase": peaks.by_phase("allocated"),
        "max_prompt_tokens": prompt_tokens,
        "load_seconds": round(load_seconds, 1),
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "generation_calls": [{**g, "seconds": round(g["seconds"], 3)} for g in generations],
        "kv_cache_dropped_in_generation": detector.seen,
        **({"images_encoded": trainer.images_encoded}  # train.keep_image_features: its counts
           if getattr(trainer, "images_encoded", None) else {}),
        "per_step": per_step_fields(trainer.state.log_history),
        **({"profiled_step": warmup + steps, "training_kernels": training_kernels,
            "training_busy": training_busy} if profile else {}),
        **({"host_profile": host.functions} if host else {}),
        **({"training_host_profile": {"step": host_step, **training_host.result()}}
           if training_host else {}),
        "settings": {**knobs, "num_generations": NUM_GENERATIONS, "lora": LORA,
                     "cache_implementation": config.cache_implementation,
                     "generation_kwargs": {k: v for k, v in config.generation_kwargs.items()
                                           if k != "suppress_tokens"}},
    }


# ------------------------------------------------------------------ driver

def library_params() -> Path:
    """The params.yaml of the library the worker imports: the baseline's own beside its src/
    (its params refuse the keys added since), else the repository's."""
    import vlmrl

    beside = Path(vlmrl.__file__).resolve().parents[2] / "params.yaml"
    return beside if beside.is_file() else ROOT / "params.yaml"


def worker_params_file(knobs: dict[str, Any], baseline_src: Path | None) -> Path:
    """The params.yaml a worker for `knobs` reads (`library_params` in the worker): the
    baseline's own beside its src/, else the repository's."""
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


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


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


def doc_markers(block: str) -> tuple[str, str]:
    """The comment lines around a table block named `block` in the doc."""
    return f"<!-- gspo_step {block}: start -->", f"<!-- gspo_step {block}: end -->"


DOC_START, DOC_END = doc_markers("roofline")
REFERENCE, TODAY = "unsloth_4bit", GPU_PROFILE
FLOAT8_BEFORE = "gpu_profile_graph_fp8_before"


def roofline_table(results: dict[str, Any]) -> str:
    """The roofline table for the docs, from one results file: every measured run, with its
    speed against the Unsloth reference and today's GPU profile of the same model and length."""
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
             "vs unsloth_4bit | vs today's profile |"),
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
            f"{ratio(run, REFERENCE)} | {ratio(run, TODAY)} |")
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
            "peak_allocated_gib", "peak_reserved_gib")}
            | {"model": run.get("model", MODEL), "bound": run.get("bandwidth_fraction")})
    return runs


def results_source(spec: Path) -> tuple[Path, set[str] | None]:
    """`FILE` (every run of it) or `FILE::CONFIG,CONFIG` (those configurations' runs only: a
    file measured before a configuration's library changed keeps only the runs still current)."""
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


def speed_ratio(run: dict[str, Any], rows: list[dict[str, Any]], config: str) -> str:
    """Generated tokens/s over `config`'s at the same model and tokens; a dagger where that run
    is from another results file, i.e. another machine."""
    base = next((r for r in rows if r["config"] == config and r["model"] == run["model"]
                 and r["completion_length"] == run["completion_length"]), None)
    if base is None:
        return "-"
    ratio = run["generated_tokens_per_second"] / base["generated_tokens_per_second"]
    return f"{ratio:.2f}x" + ("" if base["file"] == run["file"] else " †")


def speed_table(files: list[Path], block: str = SPEED_BLOCK) -> str:
    """The current speed summary: per model shape and completion length, seconds per GSPO step,
    generated tokens per second and peak memory of the Unsloth reference, today's profile and
    the profiles beside them, with the speed against the first two."""
    rows = speed_rows(files)
    machines = sorted({render_results(results_source(spec)[0], machine_line) for spec in files})
    lines = [(f"{'; '.join(machines)}; 16 completions per optimizer step, LoRA r16. Written by "
              f"`benchmarks/gspo_step.py --from-json ... --doc-block {block}`; † against a run of "
              "another results file, i.e. another machine of the same kind. % of bound: the "
              "decode steps' weight reads against the copy bandwidth measured in the same call."),
             "",
             ("| model | tokens | configuration | s / step | generated tok/s | % of bound | "
              "peak GiB (reserved) | vs unsloth_4bit | vs today's profile | vs float8 before | "
              "results file |"),
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for run in rows:
        bound = run.get("bound")
        lines.append(
            f"| {model_name(run)} | {run['completion_length']} | `{run['config']}` | "
            f"{run['seconds_per_step']:.2f} | {run['generated_tokens_per_second']:.0f} | "
            f"{_fmt(100 * bound if bound else None, '.1f')} | "
            f"{run['peak_allocated_gib']:.2f} ({run['peak_reserved_gib']:.2f}) | "
            f"{speed_ratio(run, rows, REFERENCE)} | {speed_ratio(run, rows, TODAY)} | "
            f"{speed_ratio(run, rows, FLOAT8_BEFORE)} | `{run['file']}` |")
    return "\n".join(lines)


def machine_line(results: dict[str, Any]) -> str:
    """The device and the library versions a results file was measured with."""
    versions = results["versions"]
    return results["device"] + ", " + ", ".join(
        f"{name} {versions[name]}" for name in ("torch", "transformers", "trl", "peft",
                                                "bitsandbytes", "unsloth"))


def speed_line(files: list[Path]) -> str:
    """The speed summary's longest-completion rows as one sentence per model shape, for the
    README."""
    rows = speed_rows(files)
    sentences = []
    for model in sorted({r["model"] for r in rows}):
        longest = max(r["completion_length"] for r in rows if r["model"] == model)
        parts = [f"`{r['config']}` {r['seconds_per_step']:.2f} s per step, peak "
                 f"{r['peak_allocated_gib']:.2f} GiB"
                 for r in rows if r["model"] == model and r["completion_length"] == longest]
        sentences.append(f"{model.removeprefix('embedded:')}, {longest} tokens: "
                         + "; ".join(parts) + ".")
    return " ".join(sentences) + " Measured by `benchmarks/gspo_step.py`."


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


def print_steps(key: str, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        print(f"{key} step {row['step']}: " + ", ".join(
            f"{field} {row[field]:.4g}" for field in STEP_FIELDS if field in row), flush=True)


def main() -> int:
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
                        help="write the roofline table of --out (or of --from-json) into this "
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
    args = parser.parse_args()
    from vlmrl.distributed.launch import keep_one_gpu, visible_gpus

    # each run trains in one process: on a host with several GPUs, on the first (before torch
    # initialises CUDA; the workers inherit it), as the train_gspo stage does with one process
    keep_one_gpu(visible_gpus(), "benchmarks/gspo_step.py")

    if args.worker:
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
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for config in configs:
        if config not in CONFIGS:
            raise SystemExit(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
        worker_env(CONFIGS[config], args.baseline_src)  # a missing --baseline-src: before the setup
        check_timed_steps(config, CONFIGS[config], args.steps,
                          grpo_num_iterations(CONFIGS[config], args.baseline_src))
    started = time.perf_counter()
    from vlmrl.models.embedded import ensure_embedded_model

    os.environ.setdefault("VLMRL_CACHE", str(args.work / "cache"))
    import torch

    model_dir = ensure_embedded_model(args.model, seed=args.seed,
                                      device="cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the build's weights must not sit beside the workers' runs
    train_set = prepare_train_set(args.work, args.dataset_size)
    print(f"model {model_dir}; data {train_set}; setup {time.perf_counter() - started:.0f} s",
          flush=True)
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
            config = GPU_PROFILE if config == "gpu_profile" else config
            left = args.budget_s - (time.perf_counter() - started)
            key = result_key(config, length, args.model)
            if left < args.min_run_s:
                print(f"{key}: skipped, {left:.0f} s of the budget left", flush=True)
                continue
            result_file = args.work / f"{key}.json"
            result_file.unlink(missing_ok=True)
            result_file.with_suffix(".partial").unlink(missing_ok=True)
            command = [sys.executable, __file__, "--worker", config, str(length),
                       "--warmup", str(args.warmup), "--steps", str(args.steps),
                       "--model", args.model, "--seed", str(args.seed),
                       "--train-set", str(train_set), "--result", str(result_file),
                       "--others-bytes", str(device_used_bytes() or 0),
                       *(["--profile-training"] if args.profile_training else []),
                       *(["--profile-host"] if args.profile_host else []),
                       *(["--profile-training-host"] if args.profile_training_host else [])]
            print(f"== {key}", flush=True)
            run_started = time.perf_counter()
            try:
                subprocess.run(command, timeout=min(args.run_timeout_s, left - 10), check=False,
                               env=worker_env(CONFIGS[config], args.baseline_src))
            except subprocess.TimeoutExpired:
                pass
            if result_file.is_file():
                result = json.loads(result_file.read_text())
            else:
                result = {"config": config, "completion_length": length,
                          "error": f"no result after {time.perf_counter() - run_started:.0f} s "
                                   "(timed out or crashed)"}
                if result_file.with_suffix(".partial").is_file():
                    result["partial"] = json.loads(result_file.with_suffix(".partial").read_text())
            result["wall_seconds"] = round(time.perf_counter() - run_started, 1)
            if CONFIGS[config].get("library") == "baseline":
                result["library_commit"] = BASELINE_COMMIT
            result["device"] = results["device"]
            result["model"] = args.model
            result["bandwidth_fraction"] = bandwidth_fraction(result, results["bandwidth_bytes_per_s"])
            results["runs"][key] = result
            call["runs"].append(key)
            save_results(args.out, results)
            print(json.dumps({k: v for k, v in result.items()
                              if k not in ("generation_calls", "settings", "per_step")}),
                  flush=True)
            print_steps(key, result.get("per_step", []))
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
