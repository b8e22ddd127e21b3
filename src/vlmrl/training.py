"""GSPO only works when the policy has moved between generation and update: with one iteration
and one optimizer step per generation batch the sequence ratio is always 1 and nothing is ever
clipped. The config is checked for that, training logs every step for plots, and an interrupted
run resumes from its last complete checkpoint, which is only trusted if it came from the same
result-changing params and data; checkpoints of other settings are moved aside, never deleted."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trl
from datasets import load_from_disk
from matplotlib.figure import Figure

from vlmrl.answer_format import answer_format
from vlmrl.data_parallel import (
    gather_lists,
    gathered_state_dict,
    main_decides,
    record_trained_rows,
    resume_on_cpu_processes,
    save_rng_states_on_main,
)
from vlmrl.launch import DistributedParams, distributed_settings
from vlmrl.models.backend import precision_flags
from vlmrl.models.loading import backend_for, load_policy, starting_adapter
from vlmrl.models.processor import (
    chat_messages,
    has_vision,
    save_processing,
    suppressed_generation_kwargs,
)
from vlmrl.models.sampling import sample_top_k_on_cpu, top_k_settings
from vlmrl.outputs import atomic_dir
from vlmrl.params import ModelParams, Params, ParamsError
from vlmrl.portable import make_adapter_portable
from vlmrl.rewards import build_rewards
from vlmrl.tables import flatten
from vlmrl.trl_compat import (
    config_values,
    enable_compiled_generation,
    install_cpu_fallback,
    limit_generation_rows,
    step_log_rows,
)

# Set from dvc.yaml paths and other params sections, never from train.grpo.
MANAGED_GRPO_KEYS = {"output_dir", "save_steps", "save_strategy", "reward_weights",
                     "resume_from_checkpoint", "use_cpu"}
FINGERPRINT_FILE = "vlmrl_run.json"


def generation_rows(rows: int | None, config) -> int | None:
    """`train.max_generation_rows`, checked against the generation batch it splits (one
    process's share of it: each process generates its own rows)."""
    local_batch = config.generation_batch_size // config.world_size
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
    batch = int(grpo.get("per_device_train_batch_size", default))
    if batch % num_processes:
        raise ParamsError(
            f"params.yaml train.grpo.per_device_train_batch_size ({batch}) is the batch of all "
            f"processes together and must be divisible by train.distributed.num_processes "
            f"({num_processes})")
    return {**grpo, "per_device_train_batch_size": batch // num_processes}


def batch_report(config) -> dict[str, Any]:
    """The batch shape training ran with, for train.json and the stage's output."""
    per_device, processes = config.per_device_train_batch_size, config.world_size
    return {"num_processes": processes, "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "global_batch_size": per_device * processes * config.gradient_accumulation_steps,
            "generation_batch_size": config.generation_batch_size}


def grpo_field_names() -> set[str]:
    # `trl.GRPOConfig` looked up at call time: Unsloth, when chosen, replaces it on import.
    return {field.name for field in dataclasses.fields(trl.GRPOConfig)}


def build_grpo_config(grpo: Mapping[str, Any], *, output_dir: Path, save_steps: int,
                      reward_weights: list[float], model_settings: ModelParams):
    known = grpo_field_names()
    for key in grpo:
        if key not in known:
            raise ParamsError(f"params.yaml train.grpo.{key} is not a trl.GRPOConfig field "
                              f"(trl {trl.__version__}); see GRPOConfig's documentation")
        if key in MANAGED_GRPO_KEYS:
            raise ParamsError(f"params.yaml train.grpo.{key} is set by the pipeline "
                              f"(dvc.yaml paths, train.save_steps or rewards); remove it")
    grpo = config_values(trl.GRPOConfig, grpo, "train.grpo")
    if grpo.get("use_vllm") and not vllm_installed():
        raise ParamsError("params.yaml train.grpo.use_vllm is true but vllm is not installed; "
                          "pip install vllm (a build matching this torch) or set it to false")
    # LoRA on the language model: every trainable parameter takes part in each forward, so DDP
    # need not search the graph for unused ones (transformers' default does)
    kwargs = {"ddp_find_unused_parameters": False, **grpo}
    kwargs.update(output_dir=str(output_dir), save_strategy="steps", save_steps=save_steps,
                  reward_weights=reward_weights, **precision_flags(grpo, model_settings))
    warn_if_on_policy(kwargs)
    try:
        return trl.GRPOConfig(**kwargs)
    except ValueError as error:  # TrainingArguments' and GRPOConfig's own checks of the values
        raise ParamsError(f"params.yaml train.grpo: {error}") from None


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def warn_if_on_policy(kwargs: Mapping[str, Any]) -> None:
    steps_per_generation = kwargs.get("steps_per_generation") or kwargs.get(
        "gradient_accumulation_steps", 1)
    if (kwargs.get("importance_sampling_level") == "sequence"
            and kwargs.get("num_iterations", 1) == 1
            and steps_per_generation <= kwargs.get("gradient_accumulation_steps", 1)):
        warnings.warn("GSPO has no effect with num_iterations=1 and steps_per_generation <= "
                      "gradient_accumulation_steps: the policy is always on-policy, the sequence "
                      "ratio is 1 and nothing is clipped", stacklevel=2)


# ---------------------------------------------------------------- checkpoints

# Settings that change speed, memory, logging or where files go, never what is learned (issue
# 24): lowering the rows per generate call after an out-of-memory error, or switching gradient
# checkpointing on, must not throw away hours of training. A key also covers its sub-keys
# (`gradient_checkpointing_kwargs.use_reentrant`). Everything else in model, rewards,
# answer_format and train is fingerprinted, with the starting adapter and the train set: when in
# doubt a key changes the result. Each group says why it cannot.
MEMORY_ONLY = {  # the same updates, computed in more or fewer pieces or with recomputation
    "train.max_generation_rows": "rows per generate call: the same rollouts, in chunks",
    "train.grpo.gradient_checkpointing": "recomputes activations instead of keeping them",
    "train.grpo.gradient_checkpointing_kwargs": "how the recomputation runs",
    "train.grpo.torch_empty_cache_steps": "frees the CUDA cache between steps",
    "train.grpo.cache_implementation": "the KV cache's layout during generation",
    "train.grpo.generation_kwargs.max_cache_len": "the static KV cache's size",
    "train.grpo.generation_kwargs.disable_compile": "compiled or eager decoding, same tokens",
    "train.grpo.torch_compile": "compiled or eager training step",
    "train.grpo.torch_compile_backend": "the compiler of that step",
    "train.grpo.torch_compile_mode": "the compiler's mode",
    "train.grpo.ds3_gather_for_generation": "DeepSpeed ZeRO-3 gathers weights for generation",
    "train.grpo.vllm_gpu_memory_utilization": "vLLM's share of GPU memory",
    "train.grpo.vllm_enable_sleep_mode": "vLLM frees its memory between generations",
    "train.grpo.per_device_eval_batch_size": "eval batch: GRPOTrainer is given no eval set",
    "train.grpo.dataloader_num_workers": "processes that load the same batches",
    "train.grpo.dataloader_pin_memory": "page-locked host memory for the same batches",
    "train.grpo.dataloader_persistent_workers": "keeps those processes alive",
    "train.grpo.dataloader_prefetch_factor": "batches loaded ahead",
    "train.grpo.skip_memory_metrics": "memory figures in the log",
}
IO_ONLY = {  # what is logged, saved or printed, and where; not what training computes
    "train.save_steps": "how often a checkpoint is written",
    "train.resume": "whether to resume at all (false moves the checkpoints aside)",
    "train.grpo.save_total_limit": "how many checkpoints are kept",
    "train.grpo.save_only_model": "whether the optimizer state is saved too",
    "train.grpo.logging_steps": "how often a log row is written",
    "train.grpo.logging_first_step": "whether step 1 is logged",
    "train.grpo.logging_strategy": "when log rows are written",
    "train.grpo.logging_nan_inf_filter": "what the logged loss averages",
    "train.grpo.log_level": "console verbosity",
    "train.grpo.log_completions": "whether sample completions are logged",
    "train.grpo.num_completions_to_print": "how many are printed",
    "train.grpo.log_unique_prompts": "how they are printed",
    "train.grpo.log_multimodal": "whether their images are logged",
    "train.grpo.report_to": "tensorboard, trackio or none",
    "train.grpo.run_name": "the run's name in those trackers",
    "train.grpo.disable_tqdm": "progress bars",
}
NOT_FINGERPRINTED = frozenset(MEMORY_ONLY) | frozenset(IO_ONLY)


def fingerprinted(key: str) -> bool:
    """Whether a dotted settings key can change the training result (see MEMORY_ONLY, IO_ONLY)."""
    return not any(key == name or key.startswith(name + ".") for name in NOT_FINGERPRINTED)


def run_settings(params: Mapping[str, Any], init_adapter: str | None,
                 train_set: Path) -> dict[str, Any]:
    """What a checkpoint is only valid for, as dotted key -> value (JSON types)."""
    data = sorted(str(p.relative_to(train_set)) + str(p.stat().st_size)
                  for p in train_set.rglob("*") if p.is_file())
    flat = flatten({section: params.get(section) or {}
                    for section in ("model", "rewards", "answer_format", "train")})
    settings = {key: value for key, value in flat.items() if fingerprinted(key)}
    settings["init_adapter"] = init_adapter
    settings["train_set"] = hashlib.sha256("\n".join(data).encode()).hexdigest()
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def run_fingerprint(settings: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def changed_settings(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """One line per key that differs, for the user who wonders why training starts over."""
    if old is None:
        return ["the old checkpoints' marker records no settings (written by an older vlmrl)"]
    lines = []
    for key in sorted(set(old) | set(new)):
        if key not in new:
            lines.append(f"{key}: removed (was {old[key]!r})")
        elif key not in old:
            lines.append(f"{key}: added ({new[key]!r})")
        elif old[key] != new[key]:
            lines.append(f"{key}: {old[key]!r} -> {new[key]!r}")
    return lines


def read_marker(checkpoints: Path) -> dict[str, Any] | None:
    marker = checkpoints / FINGERPRINT_FILE
    try:
        settings = json.loads(marker.read_text()).get("settings")
    except (OSError, ValueError, AttributeError):
        return None
    return settings if isinstance(settings, dict) else None


def move_aside(checkpoints: Path) -> Path:
    """Renames the checkpoint folder to a sibling that no stage reads and git ignores."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = checkpoints.with_name(f"{checkpoints.name}.stale-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = checkpoints.with_name(f"{checkpoints.name}.stale-{stamp}-{suffix}")
    checkpoints.rename(target)
    return target


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    return [path for path in checkpoints.glob("checkpoint-*")
            if (path / "trainer_state.json").is_file()
            and (path / "adapter_model.safetensors").is_file()
            and path.name.split("-")[-1].isdigit()]


def last_complete_checkpoint(checkpoints: Path, settings: Mapping[str, Any],
                             resume: bool = True) -> Path | None:
    """The newest checkpoint of a run with these same settings, or None. Checkpoints of other
    settings (or all of them, with `resume` false) are moved aside, never deleted."""
    if not checkpoints.exists():
        return None
    old = read_marker(checkpoints)
    if resume and old == settings:
        complete = complete_checkpoints(checkpoints)
        if complete:
            return max(complete, key=lambda path: int(path.name.split("-")[-1]))
    if not any(checkpoints.glob("checkpoint-*")):
        shutil.rmtree(checkpoints)  # a marker and logs, no training to keep
        return None
    reasons = (["train.resume is false"] if not resume
               else changed_settings(old, settings) or ["no complete checkpoint"])
    moved = move_aside(checkpoints)
    print(f"not resuming: old checkpoints moved to {moved}, because:")
    for line in reasons:
        print(f"  {line}")
    print(f"  (nothing was deleted: with those settings back, move it back to {checkpoints} to "
          f"resume from it; `rm -rf {checkpoints}.stale-*` frees the space)")
    return None


def finished_run(checkpoint: Path | None, max_steps: int) -> bool:
    """Whether the checkpoint already holds all `max_steps` steps (a rerun after a memory-only
    change, or of a finished run)."""
    if checkpoint is None or max_steps <= 0:
        return False
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    return state.get("global_step", 0) >= max_steps


def train_or_restore(trainer, resume_from: Path | None, max_steps: int) -> None:
    """Trains from `resume_from` (None: from the start), or, where that checkpoint finished the
    run, takes its adapter and state as they are: transformers 5.17, resumed from the checkpoint
    of step `max_steps`, trains one step more (step max_steps + 1) before it checks the limit."""
    if not finished_run(resume_from, max_steps):
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        return
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import TrainerState

    print(f"{resume_from} finished all {max_steps} steps: nothing left to train")
    trainer.state = TrainerState.load_from_json(str(resume_from / "trainer_state.json"))
    weights = load_file(str(resume_from / "adapter_model.safetensors"))
    unexpected = set_peft_model_state_dict(trainer.model, weights).unexpected_keys
    if unexpected:  # the fingerprint covers train.lora, so this is a bug, not a user's error
        raise RuntimeError(f"{resume_from}: adapter weights the model has no place for: "
                           f"{sorted(unexpected)[:3]}")


def mark_checkpoints(checkpoints: Path, settings: Mapping[str, Any]) -> None:
    checkpoints.mkdir(parents=True, exist_ok=True)
    marker = {"fingerprint": run_fingerprint(settings), "settings": settings}
    (checkpoints / FINGERPRINT_FILE).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")


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
        # issue 19: every step must move the policy, and off-policy steps clip some, not all
        "min_grad_norm": min(values("grad_norm"), default=None),
        "last_grad_norm": (values("grad_norm") or [None])[-1],
        "steps_with_zero_grad_norm": sum(1 for g in values("grad_norm") if g == 0),
        "mean_frac_reward_zero_std": _mean(values("frac_reward_zero_std")),
        "step_seconds": step_seconds or [],  # wall clock: goes to the timings file
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def split_step_times(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[float]]:
    """(the log rows without TRL's `step_time`, the step times): the log must repeat exactly on
    the same params and machine, and a wall time never does (issue 19)."""
    times = [round(row["step_time"], 4) for row in rows if "step_time" in row]
    return [{k: v for k, v in row.items() if k != "step_time"} for row in rows], times


# ---------------------------------------------------------------- run

@dataclasses.dataclass
class TrainResult:
    log_rows: list[dict[str, Any]]
    summary: dict[str, Any]
    completions_dir: Path


def make_trainer(model, processor, config, dataset, reward_funcs, *,
                 generation_rows: int | None, callbacks: list):
    """TRL's GRPOTrainer with the project's generation switches: the processor's suppressed
    tokens, compiled decoding when `generation_kwargs.disable_compile` is false (TRL itself
    always disables it), generation in chunks of `generation_rows`, and on a CPU top-k sampling
    among k tokens (`vlmrl.models.sampling`)."""
    generation_kwargs = dict(config.generation_kwargs or {})
    compile_generation = generation_kwargs.pop("disable_compile", True) is False
    config.generation_kwargs = {**suppressed_generation_kwargs(processor), **generation_kwargs}
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_funcs, args=config,
                          train_dataset=dataset, processing_class=processor, callbacks=callbacks)
    if compile_generation:
        enable_compiled_generation(trainer)
    if generation_rows is not None:
        limit_generation_rows(trainer, generation_rows)
    sample_top_k_on_cpu(trainer.model, top_k_settings(
        True, config.temperature, config.top_k, config.top_p, config.min_p,
        suppress=config.generation_kwargs.get("suppress_tokens")))
    return trainer


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
          sft_out: Path | None = None) -> TrainResult | None:
    """Runs GSPO and writes the adapter; returns the per-step log and the summary (on rank 0;
    None on the other ranks of a launched run, which write nothing).
    `sft_out`: the sft_cold_start stage's output, whose adapter is continued (None, or a
    pass-through SFT: a fresh adapter). Read after the params are checked, so a params error is
    reported first."""
    model_params, train_params, rewards = params.model, params.train, params.rewards
    backend_for(model_params)  # Unsloth, when chosen, must patch TRL before its config is built
    if not (train_set / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{train_set}: no prepared train set; the prepare_data stage "
                                "makes it")
    reward_funcs, reward_weights = build_rewards(rewards.weights, rewards.options,
                                                 answer_format(params))
    distributed = distributed_settings(train_params)
    check_distributed(distributed, model_params)
    config = build_grpo_config(split_batch(train_params.grpo, distributed.num_processes),
                               output_dir=checkpoints, save_steps=train_params.save_steps,
                               reward_weights=reward_weights, model_settings=model_params)
    check_world(config, distributed.num_processes)
    rows = generation_rows(train_params.max_generation_rows, config)
    init_adapter = starting_adapter(sft_out)
    settings = run_settings(params.raw, adapter_digest(init_adapter), train_set)
    resume_from = main_decides(lambda: prepare_checkpoints(checkpoints, settings,
                                                           train_params.resume),
                               lambda: newest_checkpoint(checkpoints))

    install_cpu_fallback()
    model, processor, _backend = load_policy(model_params, train_params.lora, config.seed,
                                             init_adapter)
    dataset = policy_dataset(load_from_disk(str(train_set)), processor)
    trainer = make_trainer(model, processor, config, dataset, reward_funcs,
                           generation_rows=rows, callbacks=[])
    save_rng_states_on_main(trainer)
    resume_on_cpu_processes(trainer)
    trained_rows = record_trained_rows(trainer)
    started = time.perf_counter()
    if resume_from is not None:
        print(f"resuming from {resume_from}")
    train_or_restore(trainer, resume_from, config.max_steps)
    runtime = time.perf_counter() - started

    rows_per_process = gather_lists(trained_rows)
    state_dict = gathered_state_dict(trainer)
    if not trainer.accelerator.is_main_process:
        return None
    with atomic_dir(adapter_out) as staging:
        trainer.model.save_pretrained(str(staging), **({"state_dict": state_dict}
                                                       if state_dict is not None else {}))
        save_processing(staging, processor)
        make_adapter_portable(staging, model_params.name)
    log_rows, step_seconds = split_step_times(step_log_rows(trainer.state.log_history))
    summary = summarize_training(log_rows, runtime, trainer.state.global_step,
                                 str(resume_from) if resume_from else None, step_seconds)
    summary["batch"] = {**batch_report(config), "strategy": distributed.strategy,
                        **rows_report(rows_per_process)}
    return TrainResult(log_rows, summary, checkpoints / "completions")


def check_distributed(distributed: DistributedParams, model_params: ModelParams) -> None:
    """Settings the launched path does not support, named before anything loads."""
    if distributed.strategy == "none":
        return
    if backend_for(model_params).name == "unsloth":
        raise ParamsError("params.yaml train.distributed.strategy "
                          f"{distributed.strategy}: Unsloth trains on one GPU; set "
                          "model.backend: transformers (or strategy: none)")
    if model_params.load_in_4bit and distributed.strategy in ("zero3", "fsdp"):
        raise ParamsError(f"params.yaml model.load_in_4bit with train.distributed.strategy "
                          f"{distributed.strategy}: sharding 4-bit weights is not supported "
                          "here; use ddp or zero2")


def check_world(config, num_processes: int) -> None:
    if config.world_size != num_processes:
        raise ParamsError(f"params.yaml train.distributed.num_processes is {num_processes} but "
                          f"{config.world_size} processes were launched; let train_gspo launch "
                          "itself (python stages/train_gspo.py ...)")


def prepare_checkpoints(checkpoints: Path, settings: Mapping[str, Any],
                        resume: bool) -> Path | None:
    """Rank 0: the checkpoint to resume from (others moved aside) and the folder's marker."""
    resume_from = last_complete_checkpoint(checkpoints, settings, resume)
    mark_checkpoints(checkpoints, settings)
    (checkpoints / "completions").mkdir(exist_ok=True)
    return resume_from


def newest_checkpoint(checkpoints: Path) -> Path | None:
    """The other ranks, once rank 0 has prepared the folder: what is left there is resumable."""
    complete = complete_checkpoints(checkpoints)
    return max(complete, key=lambda path: int(path.name.split("-")[-1])) if complete else None


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
