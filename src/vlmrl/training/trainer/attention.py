"""Attention for the training forward without a padding mask (`train.training_attention:
rolled`).

GRPO's rows are a left-padded prompt and a right-padded completion, so transformers hands SDPA a
mask, and with a mask SDPA cannot take its causal flash kernel: on a GPU it takes the
memory-efficient one, which computes every block of the masked square. Each row's tokens are one
run of slots, so rolling the row until that run starts at slot 0 leaves only padding after it,
which a causal mask keeps out of every real token's attention: SDPA then runs causal with no mask.
Queries and keys carry their rotary positions already, so the roll changes no score; the output
is rolled back. Padding queries attend to real tokens and stay finite.

Whether a forward's rows are such runs is decided once per forward, where transformers builds
the mask (`rolled_mask`, registered as the implementation's mask function): a causal forward
without a filled cache whose 2D padding mask holds one run per row gets, in place of SDPA's 4D
mask, the runs themselves ([rows, 2]: first slot, length). The attention function then rolls
without looking at the host, so compiled decoder layers (`train.compile_layers`) trace it whole;
deciding it per layer would stop each compiled layer at a host synchronisation. Anything else (a
decode step, a filled or static cache, a packed or otherwise non-causal mask) gets SDPA's mask and
transformers' SDPA unchanged; a call that is not causal itself gets the runs' causal mask."""

from __future__ import annotations

import functools

import torch

ROLLED = "vlmrl_rolled_causal"  # the name `rolled_causal_attention` is registered under


def row_runs(keys: torch.Tensor) -> torch.Tensor | None:
    """Each row's run of read slots as [rows, 2] (its first slot, its length) from a 2D padding
    mask, or None unless every row reads one run of at least one slot (one host
    synchronisation)."""
    keys = keys.bool()
    slots = torch.arange(keys.shape[-1], device=keys.device)
    first = torch.where(keys, slots, keys.shape[-1]).amin(-1)
    last = torch.where(keys, slots, -1).amax(-1)
    count = keys.sum(-1)
    if not bool(((last - first + 1) == count).all() & (count > 0).all()):
        return None
    return torch.stack((first, count), dim=-1)


def is_row_runs(mask) -> bool:
    """Whether an attention call's mask is `rolled_mask`'s runs rather than SDPA's 4D mask."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype == torch.int64


def causal_mask_of(runs: torch.Tensor, length: int) -> torch.Tensor:
    """SDPA's 4D bool mask [rows, 1, length, length] of rows reading `runs`, causal."""
    slots = torch.arange(length, device=runs.device)
    keys = (slots >= runs[:, :1]) & (slots < runs[:, :1] + runs[:, 1:])
    causal = torch.ones(length, length, dtype=torch.bool, device=runs.device).tril()
    return (causal[None] & keys[:, None, :])[:, None]


def rolled_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask function for the rolled attention: each row's run where a causal
    forward without a filled cache pads its rows to one run each, else SDPA's mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    runs = None
    if (mask_function is causal_mask_function and attention_mask is not None
            and attention_mask.dim() == 2 and attention_mask.shape[-1] == kv_length
            and q_length == kv_length > 1 and _is_zero(q_offset) and _is_zero(kv_offset)):
        runs = row_runs(attention_mask)
    if runs is not None:
        return runs
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, **kwargs)


def _is_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0


def roll_rows(states: torch.Tensor, shift: torch.Tensor, dim: int) -> torch.Tensor:
    """`states` with each row's slots along `dim` rolled left by its `shift` (slot s takes slot
    s + shift, modulo the length)."""
    length = states.shape[dim]
    index = (torch.arange(length, device=states.device) + shift[:, None]) % length
    shape = [1] * states.dim()
    shape[0], shape[dim] = index.shape
    return states.gather(dim, index.view(shape).expand_as(states))


def causal_call(module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> bool:
    """Whether an attention call is causal over its own keys (no cache before them) with no
    position bias to roll."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    return bool(causal) and key.shape[2] == query.shape[2] and kwargs.get("position_bias") is None


@functools.cache  # one function per original: torch.compile's guards on it then hold
def rolled_causal_attention(original):
    """An attention function for the training forward: over `rolled_mask`'s runs, SDPA causal
    without a mask over the rolled rows; anything else goes to `original` (transformers' SDPA)."""

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if not is_row_runs(attention_mask):
            return original(module, query, key, value, attention_mask, dropout=dropout,
                            scaling=scaling, **kwargs)
        if not causal_call(module, query, key, kwargs):
            return original(module, query, key, value,
                            causal_mask_of(attention_mask, key.shape[2]), dropout=dropout,
                            scaling=scaling, **kwargs)
        starts = attention_mask[:, 0]
        rolled = (roll_rows(states, starts, dim=2) for states in (query, key, value))
        out, weights = original(module, *rolled, None, dropout=dropout, scaling=scaling,
                                **{**kwargs, "is_causal": True})
        return roll_rows(out, -starts, dim=1), weights

    return attend


def register_over_sdpa(name: str, wrap, mask_function=None) -> str:
    """Registers `wrap(transformers' SDPA)` under `name` with transformers' public
    `AttentionInterface`, and `mask_function` (SDPA's mask builder where None, so a 2D mask still
    becomes SDPA's 4D one) under the same name with `AttentionMaskInterface`; returns the name a
    model's attention implementation is set to."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, wrap(ALL_ATTENTION_FUNCTIONS["sdpa"]))
    AttentionMaskInterface.register(name, mask_function or sdpa_mask)
    return name


@functools.cache
def rolled_attention_name() -> str:
    """`rolled_causal_attention` registered over transformers' SDPA, with `rolled_mask`; its
    name."""
    return register_over_sdpa(ROLLED, rolled_causal_attention, rolled_mask)
