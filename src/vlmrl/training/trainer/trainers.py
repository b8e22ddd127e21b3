"""The trainer classes the stages train with: TRL's GRPOTrainer and SFTTrainer, subclassed, each
with the project's behaviours (vlmrl.training.trainer.mixins) and the non-finite guard
(vlmrl.training.trainer.nonfinite) in a method order that one class statement shows.

Unsloth, when chosen, replaces `trl.GRPOTrainer` and `trl.SFTTrainer` as it is imported, and a
trainer must extend what it put there; so each class has a second class statement over Unsloth's
replacement, made when that replacement is first seen (`grpo_class`, `sft_class`). Unsloth's GRPOTrainer scores with its own log-probability function, so its subclass
leaves out `OldLogProbsWhereNeeded` and the private names only that relies on. Training runs on
an attention backend whose backward is finite (`vlmrl.models.backend.avoid_cudnn_attention`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trl

from vlmrl.models.backend import avoid_cudnn_attention
from vlmrl.training.trainer.mixins import (
    CheckedTrainer,
    ChunkedGeneration,
    CompiledTrainingLayers,
    CompletionsTableToFile,
    DataParallelRun,
    KeptImagesInTraining,
    OldLogProbsWhereNeeded,
    PixelValuesInTowerDtype,
    RestorableRun,
    TrainerLogToStdout,
)
from vlmrl.training.trainer.nonfinite import NonFiniteGuard
from vlmrl.training.trainer.private_names import GRPO_NAMES, OLD_LOGPS_NAMES, SFT_NAMES


class VlmrlGRPOTrainer(CheckedTrainer, ChunkedGeneration, CompiledTrainingLayers,
                       KeptImagesInTraining, PixelValuesInTowerDtype, OldLogProbsWhereNeeded,
                       DataParallelRun, RestorableRun, CompletionsTableToFile, NonFiniteGuard,
                       trl.GRPOTrainer, TrainerLogToStdout):
    """TRL's GRPOTrainer with every behaviour of vlmrl.training.trainer.mixins, the non-finite
    guard, and transformers' log lines on the stage's stdout (TrainerLogToStdout sits between
    TRL's class and transformers' Trainer)."""

    extends = trl.GRPOTrainer
    PRIVATE_NAMES = GRPO_NAMES + OLD_LOGPS_NAMES


class VlmrlSFTTrainer(CheckedTrainer, NonFiniteGuard, trl.SFTTrainer):
    """TRL's SFTTrainer with the private-name check, the log-prob kernel this machine can run
    and the non-finite guard."""

    extends = trl.SFTTrainer
    PRIVATE_NAMES = SFT_NAMES


@functools.cache
def unsloth_grpo_class(replacement: type) -> type:
    """GRPOTrainer's behaviours over Unsloth's replacement of `trl.GRPOTrainer`."""

    class VlmrlUnslothGRPOTrainer(CheckedTrainer, ChunkedGeneration, CompiledTrainingLayers,
                                  KeptImagesInTraining, PixelValuesInTowerDtype, DataParallelRun,
                                  RestorableRun, CompletionsTableToFile, NonFiniteGuard,
                                  replacement, TrainerLogToStdout):
        extends = replacement
        PRIVATE_NAMES = GRPO_NAMES

    return VlmrlUnslothGRPOTrainer


@functools.cache
def unsloth_sft_class(replacement: type) -> type:
    """SFTTrainer's behaviours over Unsloth's replacement of `trl.SFTTrainer`."""

    class VlmrlUnslothSFTTrainer(CheckedTrainer, NonFiniteGuard, replacement):
        extends = replacement
        PRIVATE_NAMES = SFT_NAMES

    return VlmrlUnslothSFTTrainer


def is_trls_own(trainer_class: type) -> bool:
    return trainer_class.__module__.startswith("trl.")


def grpo_class() -> type:
    """The GRPO subclass of what `trl.GRPOTrainer` is now: TRL's own, or Unsloth's replacement.
    (Where unsloth was imported before this module, VlmrlGRPOTrainer was built over the
    replacement and is never used.)"""
    return _subclass_of_current("GRPO", VlmrlGRPOTrainer, unsloth_grpo_class)


def sft_class() -> type:
    """The SFT subclass of what `trl.SFTTrainer` is now: TRL's own, or Unsloth's replacement."""
    return _subclass_of_current("SFT", VlmrlSFTTrainer, unsloth_sft_class)


def _subclass_of_current(kind: str, ours: type, unsloth_class: Callable[[type], type]) -> type:
    """`ours` where `trl.<kind>Trainer` is still the TRL class it extends; over another class of
    TRL's, an error; over a replacement from elsewhere (Unsloth's), `unsloth_class` of it."""
    name = f"{kind}Trainer"
    current = getattr(trl, name)
    if current is ours.extends and is_trls_own(current):
        return ours
    if is_trls_own(current):
        raise RuntimeError(f"trl.{name} is {current.__qualname__} of {current.__module__}, "
                           f"not the class vlmrl's {kind} trainer extends")
    return unsloth_class(current)


def grpo_trainer(*, max_nonfinite_steps: int, generation_rows: int | None = None,
                 compile_generation: bool = False, compile_layers: bool = False,
                 nf4_linears: bool = False, keep_image_features: bool = False,
                 completions_table: Path | None = None, **kwargs: Any):
    """`trl.GRPOTrainer(**kwargs)` with the non-finite guard (`train.max_nonfinite_steps`),
    generation in chunks of `generation_rows` (`train.max_generation_rows`), compiled decoding
    where `compile_generation`, the text decoder layers compiled outside generation where
    `compile_layers` (`train.compile_layers`; their NF4 projections through vlmrl.training.trainer.nf4_linear
    where `nf4_linears`), each image through the vision tower once a
    generation where `keep_image_features` (`train.keep_image_features`), and the sample
    completions table in `completions_table`."""
    avoid_cudnn_attention()
    return grpo_class()(max_nonfinite_steps=max_nonfinite_steps,
                        limit_key="train.max_nonfinite_steps", generation_rows=generation_rows,
                        compile_generation=compile_generation, compile_layers=compile_layers,
                        nf4_linears=nf4_linears, keep_image_features=keep_image_features,
                        completions_table=completions_table, **kwargs)


def sft_trainer(*, max_nonfinite_steps: int, **kwargs: Any):
    """`trl.SFTTrainer(**kwargs)` with the non-finite guard (`sft.max_nonfinite_steps`)."""
    avoid_cudnn_attention()
    return sft_class()(max_nonfinite_steps=max_nonfinite_steps,
                       limit_key="sft.max_nonfinite_steps", **kwargs)
