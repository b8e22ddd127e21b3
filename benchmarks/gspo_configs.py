"""The training configurations `gspo_step.py` times, each a set of knobs on the same work: 16
completions of the run's length per optimizer step (4 prompts x 4 generations), LoRA r16/alpha16
on the language model's 7 projections, gradient checkpointing. Equal work is what makes seconds
per step and tokens per second comparable across rows, so it is asserted at import.

  unsloth_4bit        the seed notebooks' reference: Unsloth FastVisionModel in 4-bit, Unsloth's
                      patched GRPOTrainer, Hugging Face generate, steps_per_generation = GA
  transformers_bf16   transformers + PEFT in bf16, plain TRL GRPOTrainer, steps_per_generation = GA
  transformers_4bit   the same with bitsandbytes NF4 4-bit
  gpu_profile_*       NF4, a static KV cache sized once (max_cache_len), compiled decoding through
                      TRL's generate (transformers' auto-compile, which TRL switches off), and a
                      generation batch shape per candidate; `gpu_profile` is GPU_PROFILE
  gpu_profile_graph*  the project's graph decoding (vlmrl.training.rollout.graph_decode) and the
                      switches the recipes are built from; RECIPE_2B_PROFILE and RECIPE_8B_PROFILE
                      are the recipes' own (tests/test_training.py holds each recipe to it)
  gpu_profile_vllm    TRL's vLLM colocate generation; only where vllm is installed

The recipe's switches (`RECIPE_VARIANTS`) each make one more configuration, timed beside the
recipe in one device call so that the change is measured against the same host.
"""

from __future__ import annotations

from typing import Any

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
    # A generation batch larger than the optimizer step's 16 completions serves two steps, the
    # second off-policy (GSPO's ratio and clipping act); one of 16 is on-policy; rows16 caps each
    # generate call (and the static cache) at 16 rows.
    "gpu_profile_mb2_spg4": profile_candidate(2, 4),            # 2 x 8 rows per step
    "gpu_profile_mb2_spg8": profile_candidate(2, 8),            # 16 rows per step
    "gpu_profile_mb2_spg16_rows16": profile_candidate(2, 16, 16),  # 32 rows per 2 steps
    "gpu_profile_mb4_spg4": profile_candidate(4, 4),            # 16 rows per step
    "gpu_profile_mb4_spg8_rows16": profile_candidate(4, 8, 16),   # 32 rows per 2 steps
    "gpu_profile_mb8_spg4_rows16": profile_candidate(8, 4, 16),   # 32 rows per 2 steps
    # bf16 weights, compiled static-cache decoding, one generation of 32 rows for two optimizer
    # steps: faster than NF4 at about twice the memory.
    "gpu_profile_bf16": {"backend": "transformers", "load_in_4bit": False, **REFERENCE_BATCH,
                         "steps_per_generation": 2 * GRAD_ACCUM, "static_cache": True,
                         "compile": True},
}
# vLLM colocate (paged attention, continuous batching, CUDA graphs) in place of HF generate,
# bf16 weights, one generation for two optimizer steps. Its wheels cannot be carried to the
# offline test GPU, so there the run is recorded as skipped.
CONFIGS["gpu_profile_vllm"] = {"backend": "transformers", "load_in_4bit": False, **REFERENCE_BATCH,
                               "steps_per_generation": 2 * GRAD_ACCUM, "static_cache": False,
                               "compile": False, "vllm": True}
VLLM_SETTINGS = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
                 "vllm_enable_sleep_mode": True}
# The decode step in one CUDA graph (train.graph_decoding): "graph" on the profile's batch shape
# (NF4, 16 rows per generate call) and in bf16 with all 32 rows in one call; "merged" (the
# adapter folded into bf16 copies of the weights for decoding) with 32 rows. "compile": the
# decode step's forward under torch.compile inside the graph. "expandable_segments":
# train.expandable_segments (vlmrl.distributed.launch.use_expandable_segments).
CONFIGS["gpu_profile_graph"] = {**profile_candidate(8, 4, 16), "compile": True, "graph": "graph",
                                "expandable_segments": True}
CONFIGS["gpu_profile_graph_cached_segments"] = {**CONFIGS["gpu_profile_graph"],
                                                "expandable_segments": False}
CONFIGS["gpu_profile_graph_eager"] = {**CONFIGS["gpu_profile_graph"], "compile": False}
CONFIGS["gpu_profile_graph_bf16"] = {**profile_candidate(8, 4), "load_in_4bit": False,
                                     "compile": True, "graph": "graph"}
CONFIGS["gpu_profile_graph_merged"] = {**CONFIGS["gpu_profile_graph_bf16"], "graph": "merged"}
# All 32 rows of a generation in one call: the static cache twice as large in bf16 ("rows32"), or
# the same size in float8 (train.kv_cache_dtype fp8).
CONFIGS["gpu_profile_graph_rows32"] = {**CONFIGS["gpu_profile_graph"], "max_generation_rows": 32}
CONFIGS["gpu_profile_graph_fp8"] = {**CONFIGS["gpu_profile_graph_rows32"],
                                    "kv_cache_dtype": "fp8"}
# Micro-batches of 4 (the same 16 completions per optimizer step, one generation of 32 rows for
# two steps) checkpoint the activations of half the rows: the 8B shape's peak.
CONFIGS["gpu_profile_graph_fp8_mb4"] = {**CONFIGS["gpu_profile_graph_fp8"],
                                        "per_device_train_batch_size": 4,
                                        "gradient_accumulation_steps": 4,
                                        "steps_per_generation": 8}
# The training forward's rows rolled: causal SDPA without a padding mask
# (train.training_attention rolled, vlmrl.training.trainer.attention).
CONFIGS["gpu_profile_graph_fp8_rolled"] = {**CONFIGS["gpu_profile_graph_fp8"],
                                           "training_attention": "rolled"}
CONFIGS["gpu_profile_graph_fp8_mb4_rolled"] = {**CONFIGS["gpu_profile_graph_fp8_mb4"],
                                               "training_attention": "rolled"}
# The text decoder layers compiled for training (train.compile_layers); with the rows rolled each
# layer is still one compiled graph (the rows' runs come from the mask function).
for _name in ("gpu_profile_graph_fp8", "gpu_profile_graph_fp8_mb4", "gpu_profile_graph_fp8_rolled",
              "gpu_profile_graph_fp8_mb4_rolled"):
    CONFIGS[f"{_name}_compiled"] = {**CONFIGS[_name], "compile_layers": True}
# A generation of 48 rows for three optimizer steps in one call: the decode step reads each
# weight once for half as many rows again, at a larger cache.
CONFIGS["gpu_profile_graph_fp8_mb4_rows48_rolled_compiled"] = {
    **CONFIGS["gpu_profile_graph_fp8_mb4_rolled_compiled"], "steps_per_generation": 12,
    "max_generation_rows": 48}
# The NF4 decode kernel's one-block tiles (one scale block a K step, the adapter's x A^T in
# float32 on CUDA cores), for a same-call comparison with the wide kernel.
for _name in ("gpu_profile_graph_fp8_compiled", "gpu_profile_graph_fp8_mb4_compiled"):
    CONFIGS[f"{_name}_narrow"] = {**CONFIGS[_name], "decode_tiles": {"block_n": 128}}
WIDE_TILES = {"block_n": 128, "k_blocks": 2, "xa_precision": "fp16"}  # TILES but for `partials`
RECIPE_VARIANTS = {
    # each K step of the NF4 kernel in the tensor cores' lane order (`Tiles.lane_order`), on the
    # tiles it was timed with
    "lanes": {"decode_tiles": {**WIDE_TILES, "lane_order": True, "partials": "float32"}},
    # the NF4 kernel's partial sums between its two launches in bfloat16 (the shipped tiles) and
    # in float32
    "parts_bf16": {"decode_tiles": {**WIDE_TILES, "partials": "bfloat16"}},
    "parts_float32": {"decode_tiles": {**WIDE_TILES, "partials": "float32"}},
    # each image through the vision tower once a generation (train.keep_image_features)
    "images": {"keep_image_features": True},
    # reentrant gradient checkpointing: a layer's first forward without autograd, no saved-tensor
    # hooks on the host
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
RECIPE_2B_PROFILE = "gpu_profile_graph_fp8_rolled_compiled_images"  # mathvista-qwen3-vl-2b.yaml's
RECIPE_8B_PROFILE = "gpu_profile_graph_fp8_mb4_rolled_compiled_images"  # mathvista-qwen3-vl-8b's
# The float8 profile on the library of BASELINE_COMMIT (the NF4 kernel's tree decode and float32
# block scales, old log-probs for every row), run from an exported copy (`--baseline-src`): a
# fixed point that a device call measures beside the current code, so a ratio to it is taken
# within one call, whatever the host.
CONFIGS["gpu_profile_graph_fp8_before"] = {**CONFIGS["gpu_profile_graph_fp8"], "library": "baseline"}
BASELINE_COMMIT = "f4681fd"
GPU_PROFILE = "gpu_profile_mb8_spg4_rows16"
CONFIGS["gpu_profile"] = CONFIGS[GPU_PROFILE]
for _name, _knobs in CONFIGS.items():  # equal work: 16 completions per optimizer step
    assert (_knobs["per_device_train_batch_size"] * _knobs["gradient_accumulation_steps"]
            == PER_DEVICE_BATCH * GRAD_ACCUM), _name
