"""How training's rollouts reach their own decoding. TRL's GRPOTrainer calls `generate` on the
PEFT model, which hands the call to the transformers model under it; so the policy is loaded as a
subclass of its transformers class (`rollout_class`, chosen at load time through
`load_policy(..., model_class=rollout_class)`) whose `generate` goes to the decoding set with
`set_rollout_generate` (graph decoding on a GPU, the top-k sampler on a CPU), or to transformers'
own where none is set. Evaluation, verify and export load the plain classes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from transformers import LogitsProcessorList

from vlmrl.models.sampling import SamplingSettings, on_cpu, sampling_kwargs
from vlmrl.training.rollout.decode_attention import generative_model


class RolloutGeneration:
    """Mixin put before a transformers model class: `generate` calls the rollout decoding where
    one is set (it receives transformers' own `generate`, bound, as its fallback)."""

    rollout_generate: Callable[..., Any] | None = None

    def generate(self, *args: Any, **kwargs: Any):
        if self.rollout_generate is None:
            return super().generate(*args, **kwargs)
        return self.rollout_generate(*args, **kwargs)

    def transformers_generate(self, *args: Any, **kwargs: Any):
        """transformers' `generate`, whatever decoding is set."""
        return super().generate(*args, **kwargs)

    def set_rollout_generate(self, decoding: Callable[..., Any] | None) -> None:
        """Routes `generate` to `decoding` (None: back to transformers')."""
        self.rollout_generate = decoding


@functools.cache
def rollout_class(model_class: type) -> type:
    """`model_class` with `RolloutGeneration` in front, under the same name and module (the
    names transformers writes into a saved config and reads the modeling source by), one class
    per model class."""

    class Rollout(RolloutGeneration, model_class):
        __module__ = model_class.__module__
        __qualname__ = model_class.__qualname__
        __doc__ = model_class.__doc__

    Rollout.__name__ = model_class.__name__
    return Rollout


def rollout_model(model) -> RolloutGeneration:
    """The transformers model under `model` (a PEFT wrapper or itself), which must have been
    loaded with `rollout_class`."""
    inner = generative_model(model)
    if not isinstance(inner, RolloutGeneration):
        raise TypeError(f"{type(inner).__name__} was not loaded for rollouts: load the policy with "
                        "load_policy(..., model_class=vlmrl.training.rollout.generation.rollout_class) "
                        "(model.backend transformers)")
    return inner


class TopKGenerate:
    """`generate` that samples through `vlmrl.models.sampling.TopKSampler` (greedy mode over the
    sampler's one finite score, after any processor of the call). TRL calls `generate` with its
    own GenerationConfig, so the switch to greedy mode goes in as keyword arguments, which take
    precedence over it."""

    def __init__(self, original: Callable[..., Any], settings: SamplingSettings) -> None:
        self.original = original
        self.settings = settings

    def __call__(self, *args: Any, logits_processor: LogitsProcessorList | None = None,
                 **kwargs: Any):
        return self.original(*args, **kwargs, **sampling_kwargs(self.settings, logits_processor))


def sample_top_k_on_cpu(model, settings: SamplingSettings | None) -> bool:
    """Makes the policy's `generate` sample through `TopKSampler` when it is on a CPU and the
    settings allow it (on a CPU transformers' sampling over the whole vocabulary costs more than
    the tiny model); True if it did."""
    if settings is None or not on_cpu(model):
        return False
    inner = rollout_model(model)
    inner.set_rollout_generate(TopKGenerate(inner.transformers_generate, settings))
    return True
