"""Attention for the training forward without a padding mask (`train.training_attention:
rolled`).

GRPO's rows are a left-padded prompt and a right-padded completion, so transformers hands SDPA a
mask, and with a mask SDPA cannot take its causal flash kernel: on a GPU it takes the
memory-efficient one, which computes every block of the masked square. Each row's tokens are one
run of slots, so rolling the row until that run starts at slot 0 leaves only padding after it,
which a causal mask keeps out of every real token's attention: SDPA then runs causal with no mask.
Queries and keys carry their rotary positions already, so the roll changes no score; the output
is rolled back. Padding queries attend to real tokens and stay finite. A prefill into an empty
cache is such a forward too (the cache keeps the keys and values unrolled). Anything else (a
decode step, a filled cache, a mask that is not causal over one run of keys per row, a
non-causal module) goes to transformers' SDPA unchanged."""

from __future__ import annotations

import functools

import torch
from torch.utils.weak import WeakIdKeyDictionary

ROLLED = "vlmrl_rolled_causal"  # the name `rolled_causal_attention` is registered under
_ROW_STARTS = WeakIdKeyDictionary()  # by mask tensor, kept while the mask lives


def row_starts(mask: torch.Tensor) -> torch.Tensor | None:
    """Where each row's run of read slots starts, from SDPA's 4D mask [rows, 1, slots, slots] of
    a forward without a cache, or None unless the mask is causal over one run of keys per row
    (its last query's keys). Once per mask tensor: every layer of one forward, and its recompute
    under gradient checkpointing, gets the same mask (one host synchronisation per forward)."""
    if mask in _ROW_STARTS:
        return _ROW_STARTS[mask]
    keys = mask[:, 0, -1, :]
    slots = torch.arange(keys.shape[-1], device=keys.device)
    first = torch.where(keys, slots, keys.shape[-1]).amin(-1)
    last = torch.where(keys, slots, -1).amax(-1)
    causal = torch.ones(keys.shape[-1], keys.shape[-1], dtype=torch.bool,
                        device=keys.device).tril()
    expected = causal[None] & keys[:, None, :]
    rollable = ((last - first + 1) == keys.sum(-1)).all() & (mask[:, 0] == expected).all()
    _ROW_STARTS[mask] = first if bool(rollable) else None
    return _ROW_STARTS[mask]


def roll_rows(states: torch.Tensor, shift: torch.Tensor, dim: int) -> torch.Tensor:
    """`states` with each row's slots along `dim` rolled left by its `shift` (slot s takes slot
    s + shift, modulo the length)."""
    length = states.shape[dim]
    index = (torch.arange(length, device=states.device) + shift[:, None]) % length
    shape = [1] * states.dim()
    shape[0], shape[dim] = index.shape
    return states.gather(dim, index.view(shape).expand_as(states))


def rollable_call(module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                  kwargs: dict) -> bool:
    """Whether an attention call is a causal forward without a cache over SDPA's 4D bool mask
    (what `row_starts` then checks), with no position bias to roll."""
    length = query.shape[2]
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    return (mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and length > 1
            and key.shape[2] == length and mask.shape[-2:] == (length, length) and causal
            and kwargs.get("position_bias") is None)


@functools.cache  # one function per original: torch.compile's guards on it then hold
def rolled_causal_attention(original):
    """An attention function for the training forward: where the mask is causal over rows that
    each read one run of slots, SDPA causal without a mask over the rolled rows; anything else
    goes to `original` (transformers' SDPA)."""

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        starts = (row_starts(attention_mask)
                  if rollable_call(module, query, key, attention_mask, kwargs) else None)
        if starts is None:
            return original(module, query, key, value, attention_mask, dropout=dropout,
                            scaling=scaling, **kwargs)
        rolled = (roll_rows(states, starts, dim=2) for states in (query, key, value))
        out, weights = original(module, *rolled, None, dropout=dropout, scaling=scaling,
                                **{**kwargs, "is_causal": True})
        return roll_rows(out, -starts, dim=1), weights

    return attend


def register_over_sdpa(name: str, wrap) -> str:
    """Registers `wrap(transformers' SDPA)` under `name` with transformers' public
    `AttentionInterface`, and SDPA's mask builder under the same name (so a 2D mask still becomes
    SDPA's 4D one); returns the name a model's attention implementation is set to."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, wrap(ALL_ATTENTION_FUNCTIONS["sdpa"]))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@functools.cache
def rolled_attention_name() -> str:
    """`rolled_causal_attention` registered over transformers' SDPA; its name."""
    return register_over_sdpa(ROLLED, rolled_causal_attention)
