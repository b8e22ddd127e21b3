"""GSPO only works when the policy has moved between generation and update: with one iteration
and one optimizer step per generation batch the sequence ratio is always 1 and nothing is ever
clipped. The config is checked for that, training logs every step for plots, and an interrupted
run resumes from its last complete checkpoint, which is only trusted if it came from the same
params and data."""

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

from vlmrl.config import ParamsError
from vlmrl.modeling import ModelSettings, cuda_available, pick_backend, resolve_dtype
from vlmrl.rewards import build_rewards_from_params
from vlmrl.trl_compat import (
    enable_compiled_generation,
    install_cpu_fallback,
    limit_generation_rows,
)

LORA_KEYS = {"r", "alpha", "dropout", "target_modules"}
TRAIN_KEYS = {"save_steps", "resume", "lora", "grpo", "max_generation_rows"}
# Set from dvc.yaml paths and other params sections, never from train.grpo.
MANAGED_GRPO_KEYS = {"output_dir", "save_steps", "save_strategy", "reward_weights",
                     "resume_from_checkpoint", "use_cpu"}
FINGERPRINT_FILE = "vlmrl_run.json"


def check_train_params(train: Mapping[str, Any]) -> None:
    unknown = sorted(set(train) - TRAIN_KEYS)
    if unknown:
        raise ParamsError(f"params.yaml `train` has unknown keys {unknown}; known: {sorted(TRAIN_KEYS)}")
    lora = train.get("lora") or {}
    missing = sorted(LORA_KEYS - set(lora))
    extra = sorted(set(lora) - LORA_KEYS)
    if missing or extra:
        raise ParamsError(f"params.yaml `train.lora` needs exactly {sorted(LORA_KEYS)}"
                          f" (missing {missing}, unknown {extra})")


def generation_rows(train: Mapping[str, Any], config) -> int | None:
    """`train.max_generation_rows`, checked against the generation batch it splits."""
    rows = train.get("max_generation_rows")
    if rows is None:
        return None
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ParamsError(f"params.yaml `train.max_generation_rows` must be a positive integer or "
                          f"null, got {rows!r}")
    if config.generation_batch_size % rows:
        raise ParamsError(
            f"params.yaml `train.max_generation_rows` ({rows}) must divide the generation batch "
            f"(per_device_train_batch_size x steps_per_generation = "
            f"{config.generation_batch_size}): every chunk then has the same shape, so compiled "
            "decoding and its static cache are built once")
    return rows


def grpo_field_names() -> set[str]:
    from trl import GRPOConfig

    return {field.name for field in dataclasses.fields(GRPOConfig)}


def build_grpo_config(grpo: Mapping[str, Any], *, output_dir: Path, save_steps: int,
                      reward_weights: list[float], model_settings: ModelSettings):
    from trl import GRPOConfig

    known = grpo_field_names()
    for key in grpo:
        if key not in known:
            raise ParamsError(f"params.yaml `train.grpo.{key}` is not a trl.GRPOConfig field "
                              f"(trl {_trl_version()}); see GRPOConfig's documentation")
        if key in MANAGED_GRPO_KEYS:
            raise ParamsError(f"params.yaml `train.grpo.{key}` is set by the pipeline "
                              f"(dvc.yaml paths, train.save_steps or rewards); remove it")
    if grpo.get("use_vllm") and not vllm_installed():
        raise ParamsError("params.yaml `train.grpo.use_vllm` is true but vllm is not installed; "
                          "pip install vllm (a build matching this torch) or set it to false")
    kwargs = dict(grpo)
    kwargs.update(output_dir=str(output_dir), save_strategy="steps", save_steps=save_steps,
                  reward_weights=reward_weights, **precision_flags(grpo, model_settings))
    warn_if_on_policy(kwargs)
    return GRPOConfig(**kwargs)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def precision_flags(grpo: Mapping[str, Any], model_settings: ModelSettings) -> dict[str, Any]:
    if not cuda_available():
        return {"use_cpu": True, "bf16": False, "fp16": False}
    import torch

    dtype = resolve_dtype(model_settings.dtype)
    return {"bf16": grpo.get("bf16", dtype == torch.bfloat16),
            "fp16": grpo.get("fp16", dtype == torch.float16)}


def warn_if_on_policy(kwargs: Mapping[str, Any]) -> None:
    steps_per_generation = kwargs.get("steps_per_generation") or kwargs.get(
        "gradient_accumulation_steps", 1)
    if (kwargs.get("importance_sampling_level") == "sequence"
            and kwargs.get("num_iterations", 1) == 1
            and steps_per_generation <= kwargs.get("gradient_accumulation_steps", 1)):
        warnings.warn("GSPO has no effect with num_iterations=1 and steps_per_generation <= "
                      "gradient_accumulation_steps: the policy is always on-policy, the sequence "
                      "ratio is 1 and nothing is clipped", stacklevel=2)


def _trl_version() -> str:
    import trl

    return trl.__version__


# ---------------------------------------------------------------- model

def load_policy(model_settings: ModelSettings, lora: Mapping[str, Any], seed: int):
    """(peft model, processor, backend) with LoRA on the language model only."""
    backend = pick_backend(model_settings.backend)
    from vlmrl.modeling import resolve_model_path

    path = resolve_model_path(model_settings)
    if backend == "unsloth":
        from vlmrl.unsloth_backend import load_unsloth_model, unsloth_lora

        model, processor = load_unsloth_model(path, model_settings, for_training=True)
        return unsloth_lora(model, lora, seed), processor, backend
    return _transformers_policy(path, model_settings, lora), _processor(path), backend


def _processor(path: str):
    from vlmrl.modeling import load_processor

    return load_processor(path)


def _transformers_policy(path: str, model_settings: ModelSettings, lora: Mapping[str, Any]):
    from peft import LoraConfig, get_peft_model

    from vlmrl.modeling import load_transformers_model

    # 4-bit too goes straight to get_peft_model (which freezes the base; GRPOTrainer enables input
    # gradients for checkpointing). peft's prepare_model_for_kbit_training would upcast every
    # 16-bit tensor to float32, the 0.3 B-parameter embedding and so the logits among them.
    model = load_transformers_model(path, model_settings)
    model.train()
    config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=language_model_targets(model, lora["target_modules"]),
                        exclude_modules=r".*\.visual\..*", bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def language_model_targets(model, names: list[str]) -> list[str]:
    """Module names that PEFT should adapt: the given projections, never inside the vision tower."""
    wanted = set(names)
    targets = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules()
                      if name.rsplit(".", 1)[-1] in wanted and ".visual." not in f".{name}."})
    missing = sorted(wanted - set(targets))
    if missing:
        raise ParamsError(f"params.yaml `train.lora.target_modules` {missing} match no module "
                          "of the language model")
    return targets


# ---------------------------------------------------------------- checkpoints

def run_fingerprint(params: Mapping[str, Any], train_set: Path) -> str:
    data = sorted(str(p.relative_to(train_set)) + str(p.stat().st_size)
                  for p in train_set.rglob("*") if p.is_file())
    payload = json.dumps({"params": params, "data": data}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def last_complete_checkpoint(checkpoints: Path, fingerprint: str) -> Path | None:
    """The newest checkpoint of this same run, or None (stale checkpoints are removed)."""
    marker = checkpoints / FINGERPRINT_FILE
    if not marker.is_file() or json.loads(marker.read_text()).get("fingerprint") != fingerprint:
        if checkpoints.exists():
            shutil.rmtree(checkpoints)
        return None
    complete = [path for path in checkpoints.glob("checkpoint-*")
                if (path / "trainer_state.json").is_file()
                and (path / "adapter_model.safetensors").is_file()
                and path.name.split("-")[-1].isdigit()]
    return max(complete, key=lambda path: int(path.name.split("-")[-1]), default=None)


def mark_checkpoints(checkpoints: Path, fingerprint: str) -> None:
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": fingerprint}) + "\n")


# ---------------------------------------------------------------- logs

def step_log_rows(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trainer log entries as flat rows for DVC plots ('clip_ratio/region_mean' ->
    'clip_ratio_region_mean')."""
    rows = []
    for entry in log_history:
        if "step" not in entry or "train_runtime" in entry:
            continue
        row = {"step": entry["step"]}
        for key, value in entry.items():
            if isinstance(value, (int, float)) and key != "step":
                row[flat_key(key)] = value
        rows.append(row)
    return rows


def flat_key(key: str) -> str:
    return key.replace("/", "_").replace("-", "_")


def summarize_training(rows: list[dict[str, Any]], runtime: float, global_step: int,
                       resumed_from: str | None) -> dict[str, Any]:
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
    }


class StepTimer:
    """A TrainerCallback (duck-typed to avoid importing transformers here) adding step_time."""

    def __init__(self) -> None:
        self._started = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.last = time.perf_counter() - self._started

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and hasattr(self, "last"):
            logs["step_time"] = round(self.last, 4)


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
    always disables it), and generation in chunks of `generation_rows`."""
    from trl import GRPOTrainer

    from vlmrl.modeling import suppressed_generation_kwargs

    generation_kwargs = dict(config.generation_kwargs or {})
    compile_generation = generation_kwargs.pop("disable_compile", True) is False
    config.generation_kwargs = {**suppressed_generation_kwargs(processor), **generation_kwargs}
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=config,
                          train_dataset=dataset, processing_class=processor, callbacks=callbacks)
    if compile_generation:
        enable_compiled_generation(trainer)
    if generation_rows is not None:
        limit_generation_rows(trainer, generation_rows)
    return trainer


def train(*, train_set: Path, params: Mapping[str, Any], adapter_out: Path,
          checkpoints: Path) -> TrainResult:
    """Runs GSPO and writes the adapter; returns the per-step log and the summary."""
    train_params, model_settings = params["train"], ModelSettings.from_params(params["model"])
    check_train_params(train_params)
    if pick_backend(model_settings.backend) == "unsloth":
        import unsloth  # noqa: F401  (must patch TRL, transformers and PEFT before they load)
    from datasets import load_from_disk
    from transformers import TrainerCallback

    from vlmrl.embedded import save_processor_files
    from vlmrl.outputs import atomic_dir
    if not (train_set / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{train_set}: no prepared train set; the prepare_data stage makes it")
    reward_funcs, reward_weights = build_rewards_from_params(params["rewards"])
    config = build_grpo_config(train_params.get("grpo") or {}, output_dir=checkpoints,
                               save_steps=int(train_params["save_steps"]),
                               reward_weights=reward_weights, model_settings=model_settings)
    rows = generation_rows(train_params, config)
    fingerprint = run_fingerprint({k: params[k] for k in ("model", "rewards", "train")}, train_set)
    resume_from = (last_complete_checkpoint(checkpoints, fingerprint)
                   if train_params.get("resume", True) else None)
    if resume_from is None and checkpoints.exists():
        shutil.rmtree(checkpoints)
    mark_checkpoints(checkpoints, fingerprint)
    (checkpoints / "completions").mkdir(exist_ok=True)

    install_cpu_fallback()
    model, processor, _backend = load_policy(model_settings, train_params["lora"], config.seed)
    timer = type("StepTimerCallback", (StepTimer, TrainerCallback), {})()
    trainer = make_trainer(model, processor, config, load_from_disk(str(train_set)), reward_funcs,
                           generation_rows=rows, callbacks=[timer])
    started = time.perf_counter()
    if resume_from is not None:
        print(f"resuming from {resume_from}")
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    runtime = time.perf_counter() - started

    with atomic_dir(adapter_out) as staging:
        trainer.model.save_pretrained(str(staging))
        save_processor_files(staging, processor.image_processor, processor.tokenizer)
    rows = step_log_rows(trainer.state.log_history)
    summary = summarize_training(rows, runtime, trainer.state.global_step,
                                 str(resume_from) if resume_from else None)
    return TrainResult(rows, summary, checkpoints / "completions")


def plot_training_curves(rows: list[dict[str, Any]], path: Path) -> None:
    """Reward, clip ratio and completion length against step, as one PNG (renders offline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "reward"), ("clip_ratio_region_mean", "clip ratio"),
              ("completions_mean_length", "completion length (tokens)")]
    figure, axes = plt.subplots(1, len(panels), figsize=(12, 3.2))
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
    plt.close(figure)
    tmp.replace(path)
