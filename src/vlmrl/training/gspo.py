"""GSPO only works when the policy has moved between generation and update: with one iteration
and one optimizer step per generation batch the sequence ratio is always 1 and nothing is ever
clipped. The config is checked for that, training logs every step for plots, and an interrupted
run resumes from its last complete checkpoint, which is only trusted if it came from the same
result-changing params and data; checkpoints of other settings are moved aside, never deleted."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trl
from datasets import load_from_disk
from matplotlib.figure import Figure

from vlmrl.distributed.data_parallel import (
    gather_lists,
    gathered_state_dict,
    main_decides,
    split_global_batch,
)
from vlmrl.distributed.launch import (
    DistributedParams,
    check_strategy,
    check_world,
    distributed_settings,
    is_main_process,
    use_expandable_segments,
)
from vlmrl.models.loading import backend_for, load_policy, starting_adapter
from vlmrl.models.portable import make_adapter_portable
from vlmrl.models.processor import (
    chat_messages,
    has_vision,
    save_processing,
    suppressed_generation_kwargs,
)
from vlmrl.models.sampling import on_cpu, top_k_settings
from vlmrl.outputs import atomic_dir
from vlmrl.params import ModelParams, Params, ParamsError, TrainParams
from vlmrl.rewards.answer_format import answer_format
from vlmrl.rewards.functions import build_rewards
from vlmrl.training.checkpoints import (
    moved_back_on_failure,
    newest_checkpoint,
    prepare_checkpoints,
    run_settings,
    train_or_restore,
)
from vlmrl.training.rollout.generation import rollout_class, sample_top_k_on_cpu
from vlmrl.training.rollout.graph_decode import install_graph_decoding
from vlmrl.training.trainer.compiled_layers import FrozenHeapAfterFirstStep
from vlmrl.training.trainer.config import build_trainer_config
from vlmrl.training.trainer.logs import finite_rows, live_log, step_log_rows
from vlmrl.training.trainer.trainers import grpo_trainer


def generation_rows(rows: int | None, config) -> int | None:
    """`train.max_generation_rows`, at most one process's share of the generation batch (each
    process generates its own rows), which it must divide."""
    return local_generation_rows(rows, config.generation_batch_size // config.world_size)


def local_generation_rows(rows: int | None, local_batch: int) -> int | None:
    """`rows` capped at `local_batch`, the generation batch of one process: a recipe's rows then
    hold at any process count whose share it divides or exceeds."""
    rows = None if rows is None else min(rows, local_batch)
    if rows is not None and local_batch % rows:
        raise ParamsError(
            f"params.yaml train.max_generation_rows ({rows}) must divide the generation batch "
            f"of one process (per_device_train_batch_size x steps_per_generation / "
            f"train.distributed.num_processes = {local_batch}): every chunk then has the same "
            "shape, so compiled decoding and its static cache are built once")
    return rows


def split_batch(grpo: Mapping[str, Any], num_processes: int) -> dict[str, Any]:
    """`train.grpo` with the global `per_device_train_batch_size` of params.yaml shared among
    `num_processes` processes (accelerate's `split_batches`): the optimizer batch (x gradient
    accumulation) and the generation batch (x steps_per_generation) stay what params say."""
    default = trl.GRPOConfig.__dataclass_fields__["per_device_train_batch_size"].default
    return split_global_batch(grpo, num_processes, default, "train.grpo")


def batch_report(config) -> dict[str, Any]:
    """The batch shape training ran with, for train.json and the stage's output."""
    per_device, processes = config.per_device_train_batch_size, config.world_size
    return {"num_processes": processes, "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "global_batch_size": per_device * processes * config.gradient_accumulation_steps,
            "generation_batch_size": config.generation_batch_size}


def build_grpo_config(grpo: Mapping[str, Any], *, output_dir: Path, save_steps: int,
                      reward_weights: list[float], model_settings: ModelParams):
    """`train.grpo` as a trl.GRPOConfig, with the checkpoint path and interval and the reward
    weights the pipeline sets."""
    if grpo.get("use_vllm") and not vllm_installed():
        raise ParamsError("params.yaml train.grpo.use_vllm is true but vllm is not installed; "
                          "pip install vllm (a build matching this torch) or set it to false")
    # `trl.GRPOConfig` looked up at call time: Unsloth, when chosen, replaces it on import.
    # LoRA on the language model: every trainable parameter takes part in each forward, so DDP
    # need not search the graph for unused ones (transformers' default does)
    config = build_trainer_config(
        trl.GRPOConfig, grpo, "train.grpo", model_settings=model_settings,
        defaults={"ddp_find_unused_parameters": False},
        pipeline={"output_dir": str(output_dir), "save_strategy": "steps",
                  "save_steps": save_steps, "reward_weights": reward_weights})
    warn_if_on_policy(config)
    return config


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def warn_if_on_policy(config) -> None:
    """GSPO clips nothing when every optimizer step uses a fresh generation batch once."""
    if (config.importance_sampling_level == "sequence" and config.num_iterations == 1
            and config.steps_per_generation <= config.gradient_accumulation_steps):
        warnings.warn("GSPO has no effect with num_iterations=1 and steps_per_generation <= "
                      "gradient_accumulation_steps: the policy is always on-policy, the sequence "
                      "ratio is 1 and nothing is clipped", stacklevel=3)


# ---------------------------------------------------------------- logs

def summarize_training(rows: list[dict[str, Any]], runtime: float, global_step: int,
                       resumed_from: str | None,
                       step_seconds: list[float] | None = None) -> dict[str, Any]:
    def values(key: str) -> list[float]:
        return [row[key] for row in rows if isinstance(row.get(key), (int, float))
                and not math.isnan(row[key])]

    rewards = values("reward")
    clips = values("clip_ratio_region_mean")
    return {
        "steps": global_step,
        "runtime_seconds": round(runtime, 2),
        "resumed_from": resumed_from,
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "last_reward": rewards[-1] if rewards else None,
        "last_clip_ratio": clips[-1] if clips else None,
        "max_clip_ratio": max(clips) if clips else None,
        "steps_with_clipping": sum(1 for c in clips if c > 0),
        "last_completion_length": (values("completions_mean_length") or [None])[-1],
        # every step must move the policy, and off-policy steps clip some, not all
        "min_grad_norm": min(values("grad_norm"), default=None),
        "last_grad_norm": (values("grad_norm") or [None])[-1],
        "steps_with_zero_grad_norm": sum(1 for g in values("grad_norm") if g == 0),
        "mean_frac_reward_zero_std": _mean(values("frac_reward_zero_std")),
        "nonfinite_steps": int(max(values("nonfinite_steps"), default=0)),
        "step_seconds": step_seconds or [],  # wall clock: goes to the timings file
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def split_step_times(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[float]]:
    """(the log rows without TRL's `step_time`, the step times): the log must repeat exactly on
    the same params and machine, and a wall time never does."""
    times = [round(row["step_time"], 4) for row in rows if "step_time" in row]
    return [{k: v for k, v in row.items() if k != "step_time"} for row in rows], times


def log_rows(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainer's log history as the rows of the train log (`dvc plots` reads them)."""
    return finite_rows(split_step_times(step_log_rows(log_history))[0])


@dataclasses.dataclass(frozen=True)
class LiveOutputs:
    """Files written while training runs: the train log at every logging step, the curves at
    every checkpoint save, TRL's sample completions table at every logging step."""
    log: Path
    curves: Path
    samples: Path

    def callback(self):
        return live_log(self.log, log_rows, lambda rows: plot_training_curves(rows, self.curves))


# ---------------------------------------------------------------- run

@dataclasses.dataclass
class TrainResult:
    log_rows: list[dict[str, Any]]
    summary: dict[str, Any]
    completions_dir: Path


def make_trainer(model, processor, config, dataset, reward_funcs, *,
                 generation_rows: int | None, callbacks: list, graph_decoding: str = "eager",
                 kv_cache_dtype: str = "auto", training_attention: str = "sdpa",
                 compile_layers: bool = False, nf4_linears: bool = False,
                 keep_image_features: bool = False, max_nonfinite_steps: int = 3,
                 completions_table: Path | None = None):
    """TRL's GRPOTrainer with the project's generation switches: the processor's suppressed
    tokens, compiled decoding when `generation_kwargs.disable_compile` is false (TRL itself
    always disables it), generation in chunks of `generation_rows`, on a GPU with
    `graph_decoding` the decode step in one CUDA graph (`vlmrl.training.rollout.graph_decode`) over a cache
    of `kv_cache_dtype` (`vlmrl.training.rollout.decode_attention`), the training forward's attention over
    rolled rows where `training_attention` is "rolled" (`vlmrl.training.trainer.attention`), the text
    decoder layers compiled outside generation where `compile_layers`
    (`vlmrl.training.trainer.compiled_layers`; their NF4 projections through `vlmrl.training.trainer.nf4_linear` where
    `nf4_linears`), each image through the vision tower once a generation where
    `keep_image_features` (`vlmrl.models.image_features`), on a CPU
    top-k sampling among k tokens
    (`vlmrl.training.rollout.generation`; both need the policy loaded with `rollout_class`), and steps
    with a non-finite loss or gradient skipped (`vlmrl.training.trainer.nonfinite`, at most
    `max_nonfinite_steps` in a row); TRL's sample completions table goes to
    `completions_table` (vlmrl.training.trainer.trainers). With compiled layers or decoding, Python's heap is
    frozen after the first step (`FrozenHeapAfterFirstStep`)."""
    if kv_cache_dtype != "auto" and graph_decoding == "eager":
        raise ParamsError(f"params.yaml train.kv_cache_dtype: {kv_cache_dtype} needs "
                          "train.graph_decoding graph or merged (the cache it sets), not eager")
    if nf4_linears and not compile_layers:
        raise ParamsError("params.yaml train.nf4_linears: true needs train.compile_layers: true "
                          "(the NF4 projections join the compiled layers' graphs)")
    generation_kwargs = dict(config.generation_kwargs or {})
    compile_generation = generation_kwargs.pop("disable_compile", True) is False
    config.generation_kwargs = {**suppressed_generation_kwargs(processor), **generation_kwargs}
    trainer = grpo_trainer(model=model, reward_funcs=reward_funcs, args=config,
                           train_dataset=dataset, processing_class=processor, callbacks=callbacks,
                           max_nonfinite_steps=max_nonfinite_steps, generation_rows=generation_rows,
                           compile_generation=compile_generation, compile_layers=compile_layers,
                           nf4_linears=nf4_linears, keep_image_features=keep_image_features,
                           completions_table=completions_table)
    sample_top_k_on_cpu(trainer.model, top_k_settings(
        True, config.temperature, config.top_k, config.top_p, config.min_p,
        suppress=config.generation_kwargs.get("suppress_tokens")))
    if training_attention == "rolled":
        use_rolled_attention(trainer.model)
    if graph_decoding != "eager" and not on_cpu(trainer.model):
        install_graph_decoding(trainer.model, graph_decoding, kv_cache_dtype=kv_cache_dtype)
    if compile_layers or compile_generation:
        trainer.add_callback(FrozenHeapAfterFirstStep())
    return trainer


def use_rolled_attention(model) -> None:
    """The text model attends with `vlmrl.training.trainer.attention.rolled_causal_attention`, which
    needs transformers' SDPA under it."""
    from vlmrl.training.rollout.decode_attention import attention_implementation, set_text_attention
    from vlmrl.training.trainer.attention import rolled_attention_name

    current = attention_implementation(model)
    if current != "sdpa":
        raise ParamsError("params.yaml train.training_attention: rolled needs the model's SDPA "
                          f"attention, not {current!r}")
    set_text_attention(model, rolled_attention_name())
    print("training attention: rows rolled, causal SDPA without a padding mask "
          "(train.training_attention: rolled)")


def cuda_initialised() -> bool:
    import torch

    return torch.cuda.is_initialized()


def policy_dataset(dataset, processor):
    """The prompts GRPOTrainer samples from: as prepared for a vision model; for a text model
    without the image column and with each message's text as one string, as its chat template
    takes them."""
    if has_vision(processor):
        return dataset
    dataset = dataset.remove_columns([name for name in ("image",) if name in dataset.column_names])
    return dataset.map(lambda row: {"prompt": chat_messages(processor, row["prompt"])},
                       remove_columns=["prompt"], keep_in_memory=True)


def adapter_digest(adapter: Path | None) -> str | None:
    """Checkpoints of a GSPO run are only resumed if it continued the very same SFT adapter."""
    if adapter is None:
        return None
    weights = adapter / "adapter_model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else str(adapter)


def train(*, train_set: Path, params: Params, adapter_out: Path, checkpoints: Path,
          sft_out: Path | None = None, live: LiveOutputs | None = None,
          callbacks: list | None = None) -> TrainResult | None:
    """Runs GSPO and writes the adapter; returns the per-step log and the summary (on rank 0;
    None on the other ranks of a launched run, which write nothing).
    `sft_out`: the sft_cold_start stage's output, whose adapter is continued (None, or a
    pass-through SFT: a fresh adapter). Read after the params are checked, so a params error is
    reported first. `callbacks`: more trainer callbacks (a probe's, a benchmark's)."""
    model_params, train_params, rewards = params.model, params.train, params.rewards
    # before anything here initialises CUDA (building the GRPO config does): torch reads it then
    if use_expandable_segments(train_params.expandable_segments) and cuda_initialised():
        warnings.warn("train.expandable_segments: CUDA was initialised before it was set, so "
                      "this run's allocator keeps fixed segments; the train_gspo stage sets it "
                      "before importing torch", stacklevel=2)
    backend = backend_for(model_params)  # Unsloth, when chosen, patches TRL before its config
    if not (train_set / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{train_set}: no prepared train set; the prepare_data stage "
                                "makes it")
    reward_funcs, reward_weights = build_rewards(rewards.weights, rewards.options,
                                                 answer_format(params))
    distributed = distributed_settings(train_params)
    check_distributed(distributed, model_params)
    check_graph_backend(train_params.graph_decoding, backend.name)
    check_training_switches(train_params, backend.name)
    config = build_grpo_config(split_batch(train_params.grpo, distributed.num_processes),
                               output_dir=checkpoints, save_steps=train_params.save_steps,
                               reward_weights=reward_weights, model_settings=model_params)
    check_world(config.world_size, distributed.num_processes, "stages/train_gspo.py")
    rows = generation_rows(train_params.max_generation_rows, config)
    init_adapter = starting_adapter(sft_out)
    settings = {**run_settings(params.raw, adapter_digest(init_adapter), train_set),
                "train.distributed.num_processes": distributed.num_processes,  # as resolved
                "train.distributed.strategy": distributed.strategy}
    with moved_back_on_failure(checkpoints, owner=is_main_process()):
        resume_from = main_decides(lambda: prepare_checkpoints(checkpoints, settings,
                                                               train_params.resume),
                                   lambda: newest_checkpoint(checkpoints))

        model, processor, _backend = load_policy(model_params, train_params.lora, config.seed,
                                                 init_adapter, model_class=rollout_class)
        dataset = policy_dataset(load_from_disk(str(train_set)), processor)
        trainer = make_trainer(model, processor, config, dataset, reward_funcs,
                               generation_rows=rows, callbacks=list(callbacks or []),
                               graph_decoding=train_params.graph_decoding,
                               kv_cache_dtype=train_params.kv_cache_dtype,
                               training_attention=train_params.training_attention,
                               compile_layers=train_params.compile_layers,
                               nf4_linears=train_params.nf4_linears,
                               keep_image_features=train_params.keep_image_features,
                               max_nonfinite_steps=train_params.max_nonfinite_steps,
                               completions_table=live.samples if live is not None else None)
        live = live if trainer.accelerator.is_main_process else None  # rank 0 alone writes
        if live is not None:
            trainer.add_callback(live.callback())
        started = time.perf_counter()
        if resume_from is not None:
            print(f"resuming from {resume_from}")
        train_or_restore(trainer, resume_from, config.max_steps)
        runtime = time.perf_counter() - started
    rows_per_process = gather_lists(trainer.trained_rows)
    state_dict = gathered_state_dict(trainer)
    if not trainer.accelerator.is_main_process:
        return None
    with atomic_dir(adapter_out) as staging:
        trainer.model.save_pretrained(str(staging), **({"state_dict": state_dict}
                                                       if state_dict is not None else {}))
        save_processing(staging, processor)
        make_adapter_portable(staging, model_params.name)
    logged, step_seconds = split_step_times(step_log_rows(trainer.state.log_history))
    summary = summarize_training(logged, runtime, trainer.state.global_step,
                                 str(resume_from) if resume_from else None, step_seconds)
    summary["batch"] = {**batch_report(config), "strategy": distributed.strategy,
                        **rows_report(rows_per_process)}
    return TrainResult(log_rows(trainer.state.log_history), summary, checkpoints / "completions")


def check_distributed(distributed: DistributedParams, model_params: ModelParams) -> None:
    """Settings the launched path does not support, named before anything loads."""
    if distributed.strategy != "none":
        check_strategy(distributed, backend_for(model_params).name, model_params.load_in_4bit)


def check_graph_backend(graph_decoding: str, backend: str) -> None:
    """Graph decoding routes the policy's `generate` through the class it was loaded as
    (`vlmrl.training.rollout.generation.rollout_class`); Unsloth loads its own classes."""
    if graph_decoding != "eager" and backend != "transformers":
        raise ParamsError(f"params.yaml train.graph_decoding: {graph_decoding} needs "
                          f"model.backend transformers, not {backend} (it loads its own model "
                          "classes); set train.graph_decoding: eager for it")


def check_training_switches(train_params: TrainParams, backend: str) -> None:
    """The rolled attention is registered with transformers' attention functions, which Unsloth's
    own model classes do not call; Unsloth compiles its own layers; the kept image features wrap
    transformers' Qwen3-VL vision tower, tested with its model classes only."""
    if backend == "transformers":
        return
    if train_params.training_attention == "rolled":
        raise ParamsError(f"params.yaml train.training_attention: rolled needs model.backend "
                          f"transformers, not {backend}; set train.training_attention: sdpa for it")
    if train_params.compile_layers:
        raise ParamsError(f"params.yaml train.compile_layers: true needs model.backend "
                          f"transformers, not {backend} (it compiles its own); set "
                          "train.compile_layers: false for it")
    if train_params.keep_image_features:
        raise ParamsError(f"params.yaml train.keep_image_features: true needs model.backend "
                          f"transformers, not {backend}; set train.keep_image_features: false "
                          "for it")


def rows_report(rows_per_process: list[list[Any]]) -> dict[str, Any]:
    """How the data was shared: rows each process trained on, and prompts two processes shared
    (0 when every process's generation batch holds whole groups of num_generations)."""
    prompt_sets = [set(rows) for rows in rows_per_process]
    shared = set().union(*(a & b for i, a in enumerate(prompt_sets)
                           for b in prompt_sets[i + 1:]))
    return {"rows_per_process": [len(rows) for rows in rows_per_process],
            "prompts_per_process": [len(found) for found in prompt_sets],
            "prompts_in_several_processes": len(shared)}


def plot_training_curves(rows: list[dict[str, Any]], path: Path) -> None:
    """Reward, groups with reward std 0, grad norm, clip ratio and completion length against
    step, as one PNG (matplotlib's object API: no pyplot state, no display needed)."""
    panels = [("reward", "reward"), ("frac_reward_zero_std", "groups with reward std 0"),
              ("grad_norm", "grad norm"), ("clip_ratio_region_mean", "clip ratio"),
              ("completions_mean_length", "completion length (tokens)")]
    figure = Figure(figsize=(20, 3.2))
    axes = figure.subplots(1, len(panels))
    for axis, (key, title) in zip(axes, panels):
        points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
        if points:
            axis.plot(*zip(*points), marker="o")
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=100)
    tmp.replace(path)
