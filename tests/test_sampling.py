"""The CPU sampler must draw from exactly the distribution transformers' warpers leave, and
`generate` must keep every other behaviour (stopping, padding, reproducibility)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlmrl.evaluation.evaluate import generation_kwargs
from vlmrl.models.processor import vision_token_ids
from vlmrl.models.sampling import (
    SamplingSettings,
    TopKSampler,
    candidate_probs,
    draw,
    top_k_settings,
)
from vlmrl.params import EvalParams
from vlmrl.training.rollout.generation import rollout_class, sample_top_k_on_cpu


def transformers_probs(scores: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    warped = TemperatureLogitsWarper(settings.temperature)(None, scores.clone())
    warped = TopKLogitsWarper(settings.top_k)(None, warped)
    if settings.top_p < 1:
        warped = TopPLogitsWarper(settings.top_p)(None, warped)
    return warped.softmax(-1)


@pytest.mark.parametrize("settings", [SamplingSettings(1.0, 20, 0.8), SamplingSettings(0.7, 20, 0.8),
                                      SamplingSettings(1.3, 50, 1.0), SamplingSettings(2.0, 5, 0.3)])
def test_candidates_carry_the_warpers_distribution(settings: SamplingSettings) -> None:
    scores = torch.randn(6, 3000, generator=torch.Generator().manual_seed(0)) * 3
    ids, probs = candidate_probs(scores, settings)
    ours = torch.zeros_like(scores).scatter(1, ids, probs)
    assert torch.allclose(ours, transformers_probs(scores, settings), atol=1e-6)


def test_draws_follow_the_candidate_probabilities() -> None:
    settings = SamplingSettings(1.0, 20, 0.9)
    scores = torch.randn(1, 500, generator=torch.Generator().manual_seed(1)) * 2
    torch.manual_seed(0)
    drawn = draw(scores.repeat(40_000, 1), settings)
    ids, probs = candidate_probs(scores, settings)
    observed = torch.bincount(drawn, minlength=500).float() / 40_000
    assert set(drawn.unique().tolist()) <= set(ids[0][probs[0] > 0].tolist())
    assert torch.allclose(observed[ids[0]], probs[0], atol=0.01)


def test_sampler_leaves_only_the_drawn_token_finite() -> None:
    scores = torch.randn(3, 100)
    top = torch.topk(scores, 4).indices
    out = TopKSampler(SamplingSettings(1.0, 4))(torch.zeros(3, 1, dtype=torch.long), scores)
    assert (torch.isfinite(out).sum(-1) == 1).all()
    assert (out.argmax(-1).unsqueeze(1) == top).any(-1).all()


def test_suppressed_tokens_are_never_drawn() -> None:
    scores = torch.zeros(2000, 50)
    scores[:, :3] = 10.0  # the three most likely tokens, suppressed
    sampler = TopKSampler(SamplingSettings(1.0, 5, suppress=(0, 1, 2)))
    torch.manual_seed(0)
    drawn = sampler(torch.zeros(2000, 1, dtype=torch.long), scores).argmax(-1)
    assert not set(drawn.tolist()) & {0, 1, 2}


def test_only_top_k_sampling_takes_the_fast_path() -> None:
    assert top_k_settings(True, 0.7, 20, 0.8) == SamplingSettings(0.7, 20, 0.8)
    assert top_k_settings(True, None, 20, None) == SamplingSettings(1.0, 20, 1.0)
    assert top_k_settings(False, 0.7, 20, 0.8) is None  # greedy
    assert top_k_settings(True, 0.7, 0, 0.8) is None  # no top-k cut: the whole vocabulary
    assert top_k_settings(True, 0.7, 20, 0.8, min_p=0.1) is None
    with pytest.raises(ValueError, match="top_p"):
        SamplingSettings(1.0, 20, 1.5)


def test_eval_kwargs_sample_with_common_random_numbers_on_every_device() -> None:
    class Processor:
        class tokenizer:
            pad_token_id = unk_token_id = 0
            convert_tokens_to_ids = staticmethod(lambda token: 1)

    settings = EvalParams(do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
    kwargs = generation_kwargs(Processor, settings)
    assert kwargs["do_sample"] is False and kwargs["top_k"] is None
    assert [type(p) for p in kwargs["logits_processor"]] == [TopKSampler]
    assert kwargs["logits_processor"][0].settings == SamplingSettings(
        0.7, 20, 0.8, suppress=tuple(vision_token_ids(Processor)))
    assert kwargs["suppress_tokens"] is None  # by the sampler, not by a vocabulary-wide where
    no_cut = generation_kwargs(Processor, EvalParams(do_sample=True, top_k=0))
    assert no_cut["do_sample"] is True and "logits_processor" not in no_cut


def test_generate_is_wrapped_on_cpu_and_keeps_other_processors() -> None:
    calls = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def generate(self, **kwargs):
            calls.append(kwargs)

    model = rollout_class(Model)()
    assert sample_top_k_on_cpu(model, None) is False
    assert sample_top_k_on_cpu(model, SamplingSettings(1.0, 20, 0.8)) is True
    suppress = TopKSampler(SamplingSettings(1.0, 1))
    model.generate(input_ids=1, logits_processor=[suppress])
    assert calls[0]["do_sample"] is False and calls[0]["input_ids"] == 1
    assert calls[0]["logits_processor"][0] is suppress
    assert isinstance(calls[0]["logits_processor"][1], TopKSampler)



def test_same_seed_draws_agree_where_the_policies_barely_differ() -> None:
    """Common random numbers: a before/after evaluation with one seed compares the policies, not
    two independent draws."""
    settings = SamplingSettings(1.0, 20)
    generator = torch.Generator().manual_seed(3)
    before = torch.randn(4000, 300, generator=generator) * 2
    after = before + torch.randn(4000, 300, generator=generator) * 0.05
    torch.manual_seed(0)
    drawn_before = draw(before, settings)
    torch.manual_seed(0)
    paired = (draw(after, settings) == drawn_before).float().mean().item()
    independent = (draw(after, settings) == drawn_before).float().mean().item()
    assert paired > 0.95
    assert independent < 0.6
