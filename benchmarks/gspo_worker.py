"""One measured run of `gspo_step.py`: one configuration at one completion length, trained in a
process of its own (Unsloth patches torch and transformers on import, so no two configurations
share a process).

The trainer is built by the train_gspo stage's own code (`vlmrl.training.gspo.make_trainer`), so
compiled decoding, graph decoding and generation in chunks are switched on exactly as the stage
does. Steps are timed between `on_step_begin` and `on_step_end` with the device synchronised;
the warm-up steps (compilation) are dropped. Every generate call is timed and counted, and the
peak memory is read inside generation and in the rest of the step. Per optimizer step the run
also keeps whether GSPO acted (`per_step`: reward, reward std, grad norm, clip ratio): on the
random-init model every completion runs to the maximum length and every reward of a group ties,
so reward std 0 and grad norm 0 are what this model gives, not a fault of the run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gspo_configs import CONFIGS, LORA, NUM_GENERATIONS, REFERENCE_BATCH, VLLM_SETTINGS
from gspo_measure import (
    KVDropDetector,
    MemoryPeaks,
    _non_pytorch_gib,
    _peak_gib,
    _reset_peak,
    _sync,
    allocator_counts,
    decode_steps_of,
    decode_weight_bytes,
    phase_means,
    time_phases,
)
from gspo_profilers import HostProfile, TrainingHostProfile, profile_training

ROOT = Path(__file__).resolve().parents[1]
# TRL's per-step log keys (flattened) that show whether an optimizer step moved the policy.
STEP_FIELDS = ("reward", "reward_std", "frac_reward_zero_std", "grad_norm",
               "clip_ratio_region_mean", "clip_ratio_low_mean", "clip_ratio_high_mean",
               "completions_mean_length")
# The trainer knobs a configuration may set that make_trainer takes as they are.
TRAINER_SWITCHES = ("training_attention", "compile_layers", "nf4_linears", "keep_image_features")


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


def library_params() -> Path:
    """The params.yaml of the library the worker imports: the baseline's own beside its src/
    (its params refuse the keys added since), else the repository's."""
    import vlmrl

    beside = Path(vlmrl.__file__).resolve().parents[2] / "params.yaml"
    return beside if beside.is_file() else ROOT / "params.yaml"


def max_prompt_tokens(dataset, processor) -> int:
    """The longest prompt (chat template + image tokens) in the set."""
    from vlmrl.evaluation.evaluate import render_prompt

    longest = 0
    for row in dataset:
        text = render_prompt(processor, row)
        inputs = processor(text=[text], images=[row["image"]], return_tensors="pt")
        longest = max(longest, int(inputs["input_ids"].shape[1]))
    return longest


def max_cache_len(prompt_tokens: int, completion_tokens: int) -> int:
    return (prompt_tokens + completion_tokens + 63) // 64 * 64


def per_step_fields(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per optimizer step (TRL logs `loss` on each) with the STEP_FIELDS it logged;
    a field TRL did not log on that step is left out."""
    from vlmrl.training.trainer.logs import step_log_rows

    return [{"step": row["step"], **{key: row[key] for key in STEP_FIELDS if key in row}}
            for row in step_log_rows(log_history) if "loss" in row]


def grpo_config(knobs: dict[str, Any], length: int, max_steps: int, model_name: str, seed: int):
    """The model settings, the GRPO config and the reward functions of a run: the params of the
    library the worker imports, with the configuration's batch shape and the benchmark's fixed
    work (16 completions of `length` tokens, gradient checkpointing, top-p 0.8 as every row was
    measured)."""
    from vlmrl.params import ModelParams, load_params
    from vlmrl.rewards.functions import build_rewards
    from vlmrl.training.gspo import build_grpo_config

    params = load_params(library_params())
    settings = ModelParams.from_params({**params.section("model"), "name": model_name,
                                        "backend": knobs["backend"],
                                        "load_in_4bit": knobs["load_in_4bit"], "dtype": "auto",
                                        "seed": seed})
    grpo = dict(params.train.grpo)
    grpo.update(max_steps=max_steps, **{key: knobs[key] for key in REFERENCE_BATCH},
                num_generations=NUM_GENERATIONS, max_completion_length=length,
                gradient_checkpointing=True, top_p=0.8,
                **({"gradient_checkpointing_kwargs": knobs["gradient_checkpointing_kwargs"]}
                   if "gradient_checkpointing_kwargs" in knobs else {}),
                log_completions=False, logging_steps=1, report_to="none", seed=seed,
                **(VLLM_SETTINGS if knobs.get("vllm") else {}))
    reward_funcs, reward_weights = build_rewards(params.rewards.weights, params.rewards.options)
    config = build_grpo_config(grpo, output_dir=Path(tempfile.mkdtemp(prefix="gspo-bench-")),
                               save_steps=10**6, reward_weights=reward_weights,
                               model_settings=settings)
    return settings, config, reward_funcs


def apply_generation_switches(config, knobs: dict[str, Any], prompt_tokens: int,
                              length: int) -> None:
    """The train_gspo stage's own switches: train.grpo.cache_implementation and
    generation_kwargs (max_cache_len, disable_compile). The static cache is sized once for the
    longest prompt, so no call reallocates it or recompiles."""
    if knobs["static_cache"]:
        config.cache_implementation = "static"
        config.generation_kwargs = {**(config.generation_kwargs or {}),
                                    "max_cache_len": max_cache_len(prompt_tokens, length)}
    if knobs["compile"]:
        config.generation_kwargs = {**(config.generation_kwargs or {}), "disable_compile": False}


def step_timer(step_times: list[float], after_step: Callable[[], None]):
    """A TrainerCallback that appends each optimizer step's seconds, the device synchronised at
    both ends, and calls `after_step` after each."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _sync()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            step_times.append(time.perf_counter() - self.started)
            after_step()

    return StepTimer()


class GenerationLog:
    """Wraps the trainer's `_generate_single_turn` (`install`): each call's seconds,
    completions, tokens and decode steps, the peak memory inside generation apart from the rest,
    and the host profilers paused while it generates. `wrapped` is False where the trainer has
    no such method (then tokens come from TRL's own log)."""

    def __init__(self, knobs: dict[str, Any]) -> None:
        self.knobs = knobs
        self.calls: list[dict[str, Any]] = []
        self.peaks = MemoryPeaks()
        self.wrapped = False

    def install(self, trainer, profilers: list) -> None:
        self.wrapped = hasattr(trainer, "_generate_single_turn")
        if self.wrapped:
            original = trainer._generate_single_turn
            trainer._generate_single_turn = lambda *args, **kwargs: self.generate(
                trainer, profilers, original, *args, **kwargs)

    def generate(self, trainer, profilers: list, original, *args, **kwargs):
        _sync()
        self.peaks.close("training")
        started = time.perf_counter()
        with contextlib.ExitStack() as pauses:
            for profiler in profilers:
                pauses.enter_context(profiler.paused())
            completion_ids, logprobs = original(*args, **kwargs)
            _sync()
        self.peaks.close("generation")
        self.calls.append({"step": trainer.state.global_step,
                           "seconds": time.perf_counter() - started,
                           "completions": len(completion_ids),
                           "tokens": sum(len(ids) for ids in completion_ids),
                           "decode_steps": decode_steps_of(completion_ids, self.knobs)})
        return completion_ids, logprobs


def throughput(step_times: list[float], log: GenerationLog, trainer, knobs: dict[str, Any],
               warmup: int, steps: int) -> dict[str, Any]:
    """Seconds per timed step, generated tokens per second (over the whole step and over the
    generation alone), decode steps per second and the mean completion length."""
    timed = step_times[warmup:warmup + steps]  # not a profiled step after them
    generations = [g for g in log.calls if warmup <= g["step"] < warmup + steps]
    tokens = sum(g["tokens"] for g in generations)
    completions = sum(g["completions"] for g in generations)
    if not log.wrapped:  # the trainer's own log of mean completion length
        lengths = [e["completions/mean_length"] for e in trainer.state.log_history
                   if "completions/mean_length" in e][warmup:warmup + steps]
        per_step = knobs["per_device_train_batch_size"] * knobs["gradient_accumulation_steps"]
        completions = per_step * len(lengths)
        tokens = sum(lengths) * per_step
    seconds = sum(timed)
    generating = sum(g["seconds"] for g in generations)
    decode_steps = sum(g.get("decode_steps", 0) for g in generations)
    return {
        "decode_steps_per_second": decode_steps / generating if generating and decode_steps
        else None,
        "seconds_per_step": seconds / len(timed) if timed else None,
        "step_seconds": [round(t, 3) for t in step_times],
        "generated_tokens_per_step": tokens / len(timed) if timed else None,
        "generated_tokens_per_second": tokens / seconds if seconds else None,
        "generation_only_tokens_per_second": tokens / generating if generating else None,
        "generation_share": generating / seconds if seconds and log.wrapped else None,
        "generation_seconds_per_step": round(generating / len(timed), 3) if timed else None,
        "mean_completion_length": tokens / completions if completions else None,
        "warmup_steps": warmup,
        "timed_steps": len(timed),
    }


def memory(log: GenerationLog, others_bytes: int) -> dict[str, Any]:
    """Peak allocated and reserved GiB over the run, by phase, and what the process holds on the
    device beside PyTorch's pool."""
    log.peaks.close("training")
    reserved = log.peaks.overall("reserved")
    non_pytorch = _non_pytorch_gib(others_bytes)
    return {"peak_allocated_gib": log.peaks.overall("allocated"), "peak_reserved_gib": reserved,
            "non_pytorch_gib": non_pytorch,
            "peak_device_gib": round(reserved + non_pytorch, 2)
            if reserved is not None and non_pytorch is not None else None,
            "peak_allocated_gib_by_phase": log.peaks.by_phase("allocated"),
            "allocator": allocator_counts()}


def skipped(config_name: str, knobs: dict[str, Any], length: int) -> dict[str, Any] | None:
    """The result of a run that cannot run here (vLLM missing), else None."""
    if knobs.get("vllm"):
        from vlmrl.training.gspo import vllm_installed

        if not vllm_installed():
            return {"config": config_name, "completion_length": length,
                    "error": "skipped: vllm is not installed"}
    return None


def worker(config_name: str, length: int, warmup: int, steps: int, train_set: Path,
           model_name: str, seed: int, partial: Path | None = None,
           others_bytes: int = 0, profile: bool = False,
           profile_host: bool = False, profile_training_host: bool = False) -> dict[str, Any]:
    """Trains `config_name` for the warm-up, timed and profiled steps and returns what was
    measured; `partial` gets what a killed run still leaves behind after each step."""
    knobs = CONFIGS[config_name]
    if (result := skipped(config_name, knobs, length)) is not None:
        return result
    if knobs["backend"] == "unsloth":
        import unsloth  # noqa: F401  (before trl and transformers, as the notebooks do)
    from datasets import load_from_disk

    from vlmrl.distributed.launch import use_expandable_segments
    from vlmrl.models.loading import load_policy
    from vlmrl.params import LoraParams
    from vlmrl.training.gspo import make_trainer
    from vlmrl.training.rollout.generation import rollout_class

    # before anything initialises CUDA (building the GRPO config does): torch reads it then
    use_expandable_segments(knobs.get("expandable_segments", False))
    detector = KVDropDetector()
    logging.getLogger("transformers").addHandler(detector)
    host_step = warmup + steps + int(profile)  # after the timed and the profiled steps
    settings, config, reward_funcs = grpo_config(
        knobs, length, host_step + int(profile_training_host), model_name, seed)
    dataset = load_from_disk(str(train_set))

    _reset_peak()
    load_started = time.perf_counter()
    model, processor, backend = load_policy(settings, LoraParams(**LORA), config.seed,
                                            model_class=rollout_class)
    load_seconds = time.perf_counter() - load_started
    prompt_tokens = max_prompt_tokens(dataset, processor)
    apply_generation_switches(config, knobs, prompt_tokens, length)
    if "decode_tiles" in knobs:  # another tile shape for the NF4 decode kernel
        from vlmrl.training.rollout import nf4_decode

        nf4_decode.TILES = nf4_decode.Tiles(**knobs["decode_tiles"])

    step_times: list[float] = []
    log = GenerationLog(knobs)

    def leave_partial() -> None:
        if partial is not None:
            partial.write_text(json.dumps({
                "step_seconds": [round(t, 3) for t in step_times], "generation_calls": log.calls,
                "load_seconds": round(load_seconds, 1),
                "peak_allocated_gib": _peak_gib("allocated"),
                "peak_reserved_gib": _peak_gib("reserved")}))

    trainer = make_trainer(model, processor, config, dataset, reward_funcs,
                           generation_rows=knobs.get("max_generation_rows"),
                           callbacks=[step_timer(step_times, leave_partial)],
                           graph_decoding=knobs.get("graph", "eager"),
                           kv_cache_dtype=knobs.get("kv_cache_dtype", "auto"),
                           **{key: knobs[key] for key in TRAINER_SWITCHES if key in knobs})
    phase_seconds = time_phases(trainer)
    training_kernels, training_busy = (profile_training(trainer, warmup + steps) if profile
                                       else (None, None))
    host = HostProfile(trainer, warmup) if profile_host else None
    training_host = TrainingHostProfile(trainer, host_step) if profile_training_host else None
    log.install(trainer, [p for p in (host, training_host) if p is not None])

    _reset_peak()
    trainer.train()
    measured = throughput(step_times, log, trainer, knobs, warmup, steps)
    generation = measured.pop("generation_seconds_per_step")
    return {
        "decode_weight_bytes": decode_weight_bytes(model),
        "config": config_name,
        "completion_length": length,
        "backend": backend,
        "trainer_class": type(trainer).__name__,
        **measured,
        "seconds_by_phase": {**phase_means(phase_seconds, warmup, measured["timed_steps"]),
                             "generation": generation},
        "phase_calls": {phase: [[step, round(t, 3)] for step, t in found]
                        for phase, found in phase_seconds.items()},
        **memory(log, others_bytes),
        "max_prompt_tokens": prompt_tokens,
        "load_seconds": round(load_seconds, 1),
        "generation_calls": [{**g, "seconds": round(g["seconds"], 3)} for g in log.calls],
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
