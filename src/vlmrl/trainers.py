"""The trainer classes the stages train with: TRL's, with the project's behaviour added by
subclassing (vlmrl.nonfinite's guard), on an attention backend whose backward is finite
(`vlmrl.models.backend.avoid_cudnn_attention`). TRL's classes are looked up when a trainer is made, not
at import: Unsloth, when chosen, replaces `trl.GRPOTrainer` and `trl.SFTTrainer` on import, and
the subclass must extend what it put there."""

from __future__ import annotations

import functools
from typing import Any

import trl

from vlmrl.models.backend import avoid_cudnn_attention
from vlmrl.nonfinite import NonFiniteGuard


@functools.cache
def _guarded(base: type) -> type:
    return type(f"Vlmrl{base.__name__}", (NonFiniteGuard, base), {"__module__": __name__})


def grpo_trainer(*, max_nonfinite_steps: int, **kwargs: Any):
    """`trl.GRPOTrainer(**kwargs)` with the non-finite guard (`train.max_nonfinite_steps`)."""
    avoid_cudnn_attention()
    return _guarded(trl.GRPOTrainer)(max_nonfinite_steps=max_nonfinite_steps,
                                     limit_key="train.max_nonfinite_steps", **kwargs)


def sft_trainer(*, max_nonfinite_steps: int, **kwargs: Any):
    """`trl.SFTTrainer(**kwargs)` with the non-finite guard (`sft.max_nonfinite_steps`)."""
    avoid_cudnn_attention()
    return _guarded(trl.SFTTrainer)(max_nonfinite_steps=max_nonfinite_steps,
                                    limit_key="sft.max_nonfinite_steps", **kwargs)
