"""On a CPU, transformers' sampling costs more than the tiny model itself: top-p sorts the whole
151,936-token vocabulary and `torch.multinomial` walks all of it, for every row at every decoding
step, and suppressing a few tokens is a `torch.where` over all of it; together several times the
output layer's matmul (`python benchmarks/cpu_kernels.py`). With a top-k cut only k tokens can ever
be drawn, so the very same distribution (suppressed tokens removed, then temperature, top-k, and
top-p over what top-k kept, in transformers' order) is sampled among those k alone. The draw
happens in a logits processor that leaves only the drawn token finite, and `generate` runs in
greedy mode, which then picks it: the rest of generation (stopping, padding, caches, TRL's
completion masks) is transformers' own.

The processor overwrites the scores it is given (allocating a new [rows, vocabulary] tensor at
every step costs more than the draw), so it is never used where `generate` keeps raw logits.
The draw uses torch's global generator, so `torch.manual_seed` makes it repeat. Evaluations use
it on every device, for its common random numbers (`draw`); training rollouts use it on a CPU
only, where it is faster: on a GPU transformers' sampling is cheap and stays as measured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_k: int
    top_p: float = 1.0
    suppress: tuple[int, ...] = ()  # token ids never drawn (generate's `suppress_tokens`)

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"sampling temperature must be > 0, got {self.temperature}")
        if self.top_k < 1:
            raise ValueError(f"the top-k sampler needs top_k >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class TopKSampler(LogitsProcessor):
    """Draws one token per row among the top k and returns scores where only it is finite."""

    def __init__(self, settings: SamplingSettings) -> None:
        self.settings = settings
        self.suppress = torch.tensor(settings.suppress, dtype=torch.long)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if len(self.suppress):
            scores.index_fill_(1, self.suppress.to(scores.device), -float("inf"))
        drawn = draw(scores, self.settings)
        return scores.fill_(-float("inf")).scatter_(1, drawn.unsqueeze(1), 0.0)


def candidate_probs(scores: torch.Tensor, settings: SamplingSettings
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, probabilities), k per row, as transformers' Temperature, TopK and TopP warpers
    would leave them: top-p drops a token when the mass of it and every less likely candidate is at
    most 1 - top_p, and always keeps the most likely one."""
    k = min(settings.top_k, scores.shape[-1])
    values, ids = torch.topk(scores, k, dim=-1)  # a positive temperature keeps the order
    probs = (values.float() / settings.temperature).softmax(-1)
    if settings.top_p < 1:
        tail_mass = probs.flip(-1).cumsum(-1).flip(-1)  # this token and all less likely ones
        drop = tail_mass <= 1 - settings.top_p
        drop[..., 0] = False
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return ids, probs


def draw(scores: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """One token per row by the Gumbel-max trick, with each candidate's noise a hash of (a random
    key per row, the token id). Two policies sampled with the same seed then draw the same token
    unless their probabilities differ enough to change the race (common random numbers), so a
    before/after evaluation compares the policies rather than two independent draws."""
    ids, probs = candidate_probs(scores, settings)
    keys = torch.randint(0, 2**62, (ids.shape[0], 1), device=ids.device)
    gumbel = -torch.log(-torch.log(hashed_uniform(keys, ids)))
    choice = (probs.log() + gumbel).argmax(-1, keepdim=True)  # log(0): never drawn
    return ids.gather(1, choice).squeeze(1)


def hashed_uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1), one per (key, id), from splitmix64's finaliser (int64 arithmetic
    wraps around, and the shifts are masked to act as unsigned ones)."""
    z = keys * -7046029254386353131 + ids * -4658895280553007687  # 0x9E37..., 0xBF58... as int64
    z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * -7723592293110705685
    z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * 1181783497276652981
    z = z ^ ((z >> 31) & 0x1FFFFFFFF)
    mantissa = (z >> 11) & ((1 << 53) - 1)
    return (mantissa.double() + 0.5) / float(1 << 53)


def top_k_settings(do_sample: bool, temperature: float | None, top_k: int | None,
                   top_p: float | None, min_p: float | None = None,
                   suppress: list[int] | tuple[int, ...] | None = None) -> SamplingSettings | None:
    """The settings the fast path serves, or None where transformers must sample itself (greedy,
    no top-k cut, or a min-p cut)."""
    if not do_sample or not top_k or min_p:
        return None
    return SamplingSettings(temperature=temperature or 1.0, top_k=int(top_k),
                            top_p=1.0 if top_p is None else float(top_p),
                            suppress=tuple(int(i) for i in suppress or ()))


def sampling_kwargs(settings: SamplingSettings,
                    logits_processor: LogitsProcessorList | None = None) -> dict[str, Any]:
    """`generate` keyword arguments that sample with `TopKSampler` (after any other processor),
    which also does the suppression."""
    processors = LogitsProcessorList(logits_processor or [])
    processors.append(TopKSampler(settings))
    return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None,
            "suppress_tokens": None, "output_logits": False, "logits_processor": processors}


def on_cpu(model) -> bool:
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu"
