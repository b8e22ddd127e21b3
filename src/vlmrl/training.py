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
from vlmrl.models.backend import precision_flags
from vlmrl.models.graph_decode import install_graph_decoding
from vlmrl.models.loading import backend_for, load_policy, starting_adapter
from vlmrl.models.processor import (
    chat_messages,
    has_vision,
    save_processing,
    suppressed_generation_kwargs,
)
from vlmrl.models.sampling import on_cpu, sample_top_k_on_cpu, top_k_settings
from vlmrl.outputs import atomic_dir
from vlmrl.params import ModelParams, Params, ParamsError
from vlmrl.rewards import build_rewards
from vlmrl.tables import flatten
from vlmrl.trl_compat import (
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
    """`train.max_generation_rows`, checked against the generation batch it splits."""
    if rows is not None and config.generation_batch_size % rows:
        raise ParamsError(
            f"params.yaml train.max_generation_rows ({rows}) must divide the generation batch "
            f"(per_device_train_batch_size x steps_per_generation = "
            f"{config.generation_batch_size}): every chunk then has the same shape, so compiled "
            "decoding and its static cache are built once")
    return rows


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
    if grpo.get("use_vllm") and not vllm_installed():
        raise ParamsError("params.yaml train.grpo.use_vllm is true but vllm is not installed; "
                          "pip install vllm (a build matching this torch) or set it to false")
    kwargs = dict(grpo)
    kwargs.update(output_dir=str(output_dir), save_strategy="steps", save_steps=save_steps,
                  reward_weights=reward_weights, **precision_flags(grpo, model_settings))
    warn_if_on_policy(kwargs)
    return trl.GRPOConfig(**kwargs)


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

# Settings that change speed, memory or logging, never what is learned (issue 24): changing one
# after an out-of-memory error must not throw away hours of training.
NOT_FINGERPRINTED = frozenset({
    "train.max_generation_rows", "train.graph_decoding", "train.save_steps", "train.resume",
    "train.grpo.gradient_checkpointing", "train.grpo.gradient_checkpointing_kwargs",
    "train.grpo.cache_implementation", "train.grpo.generation_kwargs.max_cache_len",
    "train.grpo.generation_kwargs.disable_compile", "train.grpo.torch_compile",
    "train.grpo.torch_empty_cache_steps", "train.grpo.dataloader_num_workers",
    "train.grpo.logging_steps", "train.grpo.logging_first_step", "train.grpo.log_completions",
    "train.grpo.num_completions_to_print", "train.grpo.report_to",
})


def run_settings(params: Mapping[str, Any], init_adapter: str | None,
                 train_set: Path) -> dict[str, Any]:
    """What a checkpoint is only valid for, as dotted key -> value (JSON types)."""
    data = sorted(str(p.relative_to(train_set)) + str(p.stat().st_size)
                  for p in train_set.rglob("*") if p.is_file())
    flat = flatten({section: params.get(section) or {}
                    for section in ("model", "rewards", "answer_format", "train")})
    settings = {key: value for key, value in flat.items() if key not in NOT_FINGERPRINTED}
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
    return None


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
                 generation_rows: int | None, callbacks: list, graph_decoding: str = "off"):
    """TRL's GRPOTrainer with the project's generation switches: the processor's suppressed
    tokens, compiled decoding when `generation_kwargs.disable_compile` is false (TRL itself
    always disables it), generation in chunks of `generation_rows`, on a GPU with
    `graph_decoding` the decode step in one CUDA graph (`vlmrl.models.graph_decode`), and on a
    CPU top-k sampling among k tokens (`vlmrl.models.sampling`)."""
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
    if graph_decoding != "off" and not on_cpu(trainer.model):
        install_graph_decoding(trainer.model, graph_decoding)
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
          sft_out: Path | None = None) -> TrainResult:
    """Runs GSPO and writes the adapter; returns the per-step log and the summary.
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
    config = build_grpo_config(train_params.grpo, output_dir=checkpoints,
                               save_steps=train_params.save_steps,
                               reward_weights=reward_weights, model_settings=model_params)
    rows = generation_rows(train_params.max_generation_rows, config)
    init_adapter = starting_adapter(sft_out)
    settings = run_settings(params.raw, adapter_digest(init_adapter), train_set)
    resume_from = last_complete_checkpoint(checkpoints, settings, train_params.resume)
    mark_checkpoints(checkpoints, settings)
    (checkpoints / "completions").mkdir(exist_ok=True)

    install_cpu_fallback()
    model, processor, _backend = load_policy(model_params, train_params.lora, config.seed,
                                             init_adapter)
    dataset = policy_dataset(load_from_disk(str(train_set)), processor)
    trainer = make_trainer(model, processor, config, dataset, reward_funcs,
                           generation_rows=rows, callbacks=[],
                           graph_decoding=train_params.graph_decoding)
    started = time.perf_counter()
    if resume_from is not None:
        print(f"resuming from {resume_from}")
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    runtime = time.perf_counter() - started

    with atomic_dir(adapter_out) as staging:
        trainer.model.save_pretrained(str(staging))
        save_processing(staging, processor)
    log_rows, step_seconds = split_step_times(step_log_rows(trainer.state.log_history))
    summary = summarize_training(log_rows, runtime, trainer.state.global_step,
                                 str(resume_from) if resume_from else None, step_seconds)
    return TrainResult(log_rows, summary, checkpoints / "completions")


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
