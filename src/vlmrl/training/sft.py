"""Cold-start SFT (stage sft_cold_start): before GSPO, a few supervised steps teach the policy
the answer format the rewards score (`<REASONING>...</REASONING><SOLUTION>answer</SOLUTION>`),
as DeepSeek-R1 and Unsloth's GRPO notebooks do. A random or base model almost never writes that
format, so every GSPO group would score the same and no gradient would flow.

Design: the SFT output is the *starting LoRA adapter*, of the shape `train.lora`
sets. baseline_eval evaluates base + this adapter and train_gspo continues training the very
same adapter, so post_eval differs from the baseline only by what GSPO did, and verify, export
and upload see one adapter that holds both stages. The base weights are never copied, which
keeps this cheap for an 8B model on a GPU too.

With `sft.enabled: false` or `sft.args.max_steps: 0` the stage loads nothing and writes only
the marker (`"adapter": false`, `vlmrl.models.loading.START_MARKER`): the baseline is then the
base model itself and GSPO starts a fresh adapter.

Only train-split rows are used (the prepared train set); completions are built from each row's
gold answer, never from an eval pid. The settings are `vlmrl.params.SftParams`.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trl
from datasets import load_from_disk

from vlmrl.distributed.data_parallel import gathered_state_dict, split_global_batch
from vlmrl.distributed.launch import (
    check_strategy,
    check_world,
    distributed_settings,
    is_main_process,
)
from vlmrl.models.embedded import resolve_model_path
from vlmrl.models.loading import backend_for, load_policy, write_start_marker
from vlmrl.models.portable import make_adapter_portable
from vlmrl.models.processor import is_text_checkpoint, message_text, save_processing
from vlmrl.outputs import atomic_dir
from vlmrl.params import ModelParams, Params, SftParams
from vlmrl.rewards.answer_format import DEFAULT_FORMAT, AnswerFormat, answer_format
from vlmrl.training.trainer.config import build_trainer_config
from vlmrl.training.trainer.logs import finite_rows, live_log, step_log_rows
from vlmrl.training.trainer.trainers import sft_trainer

DEFAULT_REASONING = SftParams.model_fields["reasoning"].default


def sft_completion(answer: str, reasoning: str = DEFAULT_REASONING,
                   fmt: AnswerFormat = DEFAULT_FORMAT) -> str:
    """The target text: exactly one reasoning block, then exactly one solution block, in the
    run's answer format (the tags the scorer and the rewards read)."""
    return fmt.completion(reasoning.format(answer=answer), answer)


def sft_dataset(train_rows, reasoning: str = DEFAULT_REASONING,
                fmt: AnswerFormat = DEFAULT_FORMAT, vision: bool = True):
    """TRL's conversational prompt-completion format: the same prompt GSPO samples from, and an
    assistant turn holding the formatted gold answer. For a vision model with one `image` per
    row (what `DataCollatorForVisionLanguageModeling` reads); for a text model without it, and
    with each message's text as one string (Qwen3's chat template concatenates strings)."""

    def add_completion(row: Mapping[str, Any]) -> dict[str, Any]:
        text = sft_completion(str(row["answer"]), reasoning, fmt)
        if not vision:
            return {"completion": [{"role": "assistant", "content": text}],
                    "prompt": [{"role": m["role"], "content": message_text(m["content"])}
                               for m in row["prompt"]]}
        return {"completion": [{"role": "assistant", "content": [{"type": "text", "text": text}]}]}

    keep = {"prompt", "image", "completion"} if vision else {"prompt", "completion"}
    # in memory: a cache file next to the prepared set would change a DVC output of prepare_data
    dataset = train_rows.map(add_completion, keep_in_memory=True,
                             remove_columns=[] if vision else ["prompt"])
    return dataset.remove_columns([c for c in dataset.column_names if c not in keep])


def build_sft_config(settings: SftParams, output_dir: Path, model_settings: ModelParams,
                     vision: bool = True):
    """`sft.args` as a trl.SFTConfig, with what the pipeline sets: the collator labels only the
    completion, and vision datasets skip TRL's preparation (so no max_length, all columns);
    text datasets are tokenized by TRL as usual."""
    # `trl.SFTConfig` looked up at call time: Unsloth, when chosen, replaces it on import.
    return build_trainer_config(
        trl.SFTConfig, settings.args, "sft.args", model_settings=model_settings,
        defaults={"report_to": "none", "logging_steps": 1},
        pipeline={"output_dir": str(output_dir), "save_strategy": "no",
                  "completion_only_loss": True,
                  **({"max_length": None, "remove_unused_columns": False} if vision else {})})


def run_sft(*, train_set: Path, params: Params, out: Path,
            log: Path | None = None) -> dict[str, Any] | None:
    """Writes the starting adapter (or the pass-through marker) to `out`; returns the summary,
    with the per-step log under "log" and the wall seconds under "runtime_seconds". `log`, if
    given, is rewritten with the rows so far at every logging step. In a launched run
    (`train.distributed`) rank 0 alone writes and returns; the other ranks train in a private
    temporary directory and return None."""
    settings = params.sft
    if not settings.trains:
        with atomic_dir(out) as staging:
            write_start_marker(staging, adapter=False, summary={"steps": 0})
        return {"steps": 0, "adapter": False, "log": []}
    if not (train_set / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{train_set}: no prepared train set; the prepare_data stage "
                                "makes it")
    if not is_main_process():
        with tempfile.TemporaryDirectory(prefix="vlmrl-sft-") as scratch:
            _train(settings, params, train_set, Path(scratch), None)
        return None
    with atomic_dir(out) as staging:
        summary = _train(settings, params, train_set, staging, log)
        write_start_marker(staging, adapter=True,
                           summary={k: v for k, v in summary.items()
                                    if k not in ("log", "runtime_seconds", "batch")})
    return summary


def _train(settings: SftParams, params: Params, train_set: Path, staging: Path,
           log: Path | None) -> dict[str, Any]:
    backend = backend_for(params.model)  # Unsloth, when chosen, patches TRL before the config
    distributed = distributed_settings(params.train)
    check_strategy(distributed, backend.name, params.model.load_in_4bit)
    vision = not is_text_checkpoint(resolve_model_path(params.model))
    default = trl.SFTConfig.__dataclass_fields__["per_device_train_batch_size"].default
    args = split_global_batch(settings.args, distributed.num_processes, default, "sft.args")
    config = build_sft_config(settings.model_copy(update={"args": args}), staging / "_trainer",
                              params.model, vision)
    check_world(config.world_size, distributed.num_processes, "stages/sft.py")
    model, processor, _backend = load_policy(params.model, params.train.lora, config.seed)
    dataset = sft_dataset(load_from_disk(str(train_set)), settings.reasoning,
                          answer_format(params), vision)
    callbacks = [] if log is None else [live_log(log, log_rows)]
    trainer = sft_trainer(model=model, args=config, train_dataset=dataset,
                          processing_class=processor, callbacks=callbacks,
                          max_nonfinite_steps=settings.max_nonfinite_steps)
    started = time.perf_counter()
    trainer.train()
    runtime = time.perf_counter() - started
    state_dict = gathered_state_dict(trainer)  # collective: every rank takes part
    trainer.model.save_pretrained(str(staging), **({"state_dict": state_dict}
                                                   if state_dict is not None else {}))
    save_processing(staging, processor)
    make_adapter_portable(staging, params.model.name)  # the same files for the same adapter
    shutil.rmtree(staging / "_trainer", ignore_errors=True)
    rows = log_rows(trainer.state.log_history)
    losses = [row["loss"] for row in rows if "loss" in row]
    return {"steps": trainer.state.global_step, "adapter": True,
            "runtime_seconds": round(runtime, 2), "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "nonfinite_steps": trainer.nonfinite.skipped, "log": rows,
            "batch": {"num_processes": config.world_size, "strategy": distributed.strategy,
                      "per_device_train_batch_size": config.per_device_train_batch_size,
                      "gradient_accumulation_steps": config.gradient_accumulation_steps,
                      "global_batch_size": config.per_device_train_batch_size
                      * config.world_size * config.gradient_accumulation_steps}}


def log_rows(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainer's log history as the rows of the SFT log (`dvc plots`: loss, grad norm)."""
    return finite_rows(step_log_rows(log_history))
