"""Which checkpoints a GSPO run may resume from. A checkpoint is only trusted if it came from the
same result-changing params and data, and checkpoints of other settings are moved aside, never
deleted: after an out-of-memory error the natural move (fewer rows per generate call, gradient
checkpointing on, rerun) must not throw away hours of training. No torch at import: a finished
run's weights are restored by the trainer (vlmrl.training.trainer.mixins.RestorableRun)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vlmrl.reporting.tables import flatten

FINGERPRINT_FILE = "vlmrl_run.json"

# Settings that change speed, memory, logging or where files go, never what is learned:
# lowering the rows per generate call after an out-of-memory error, or switching gradient
# checkpointing on, must not throw away hours of training. A key also covers its sub-keys
# (`gradient_checkpointing_kwargs.use_reentrant`). Everything else in model, rewards,
# answer_format and train is fingerprinted, with the starting adapter and the train set: when in
# doubt a key changes the result. Each group says why it cannot.
MEMORY_ONLY = {  # the same updates, computed in more or fewer pieces or with recomputation
    "train.max_generation_rows": "rows per generate call: the same rollouts, in chunks",
    "train.graph_decoding": "the same decode step replayed as one CUDA graph (GPU only)",
    "train.training_attention": "the same attention, over rows rolled and causal without a mask",
    "train.compile_layers": "the same layers, compiled",
    "train.nf4_linears": "the same NF4 products, inside the compiled layers",
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
    "train.max_nonfinite_steps": "when skipped non-finite steps stop the run (a step is the same)",
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
    run, takes its adapter and state as they are (`restore_finished_run` of vlmrl.training.trainer.mixins'
    RestorableRun): transformers 5.17, resumed from the checkpoint of step `max_steps`, trains one step
    more (step max_steps + 1) before it checks the limit."""
    if not finished_run(resume_from, max_steps):
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        return
    print(f"{resume_from} finished all {max_steps} steps: nothing left to train")
    trainer.restore_finished_run(resume_from)


def mark_checkpoints(checkpoints: Path, settings: Mapping[str, Any]) -> None:
    checkpoints.mkdir(parents=True, exist_ok=True)
    marker = {"fingerprint": run_fingerprint(settings), "settings": settings}
    (checkpoints / FINGERPRINT_FILE).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")


def prepare_checkpoints(checkpoints: Path, settings: Mapping[str, Any],
                        resume: bool) -> Path | None:
    """Rank 0: the checkpoint to resume from (others moved aside) and the folder's marker."""
    resume_from = last_complete_checkpoint(checkpoints, settings, resume)
    mark_checkpoints(checkpoints, settings)
    (checkpoints / "completions").mkdir(exist_ok=True)
    return resume_from


def stale_folders(checkpoints: Path) -> set[Path]:
    """The folders `move_aside` has made beside `checkpoints`."""
    return set(checkpoints.parent.glob(f"{checkpoints.name}.stale-*"))


@contextlib.contextmanager
def moved_back_on_failure(checkpoints: Path, owner: bool = True) -> Iterator[None]:
    """A run that fails before it saved a complete checkpoint leaves the folder as it found it:
    the checkpoints this run moved aside come back, so a mistyped param costs no resumable
    training. (A run that saved some keeps them, resumable with its settings, and the old ones
    stay aside, where the message of `last_complete_checkpoint` said.) `owner`: whether this
    process moves files (rank 0)."""
    before = stale_folders(checkpoints) if owner else set()
    try:
        yield
    except BaseException:
        moved = sorted(stale_folders(checkpoints) - before) if owner else []
        if len(moved) == 1 and not complete_checkpoints(checkpoints):
            shutil.rmtree(checkpoints, ignore_errors=True)
            moved[0].rename(checkpoints)
            print(f"the run failed: the checkpoints it had moved aside are back in {checkpoints}")
        raise


def newest_checkpoint(checkpoints: Path) -> Path | None:
    """The other ranks, once rank 0 has prepared the folder: what is left there is resumable."""
    complete = complete_checkpoints(checkpoints)
    return max(complete, key=lambda path: int(path.name.split("-")[-1])) if complete else None
