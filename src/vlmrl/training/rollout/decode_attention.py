"""Attention for decode steps over the static cache, and the cache in 8 bits.

The rows decoded together share every read of the weights, so a step over 32 rows costs little
more than one over 16; what bounds the rows per generate call is the cache's memory (it grows with
rows x (prompt + completion)). Kept in float8 (e4m3, `train.kv_cache_dtype: fp8`) it takes half
the bytes, so twice the rows fit in the same memory, as vLLM's fp8 cache. Values are clamped to
e4m3's range (no scale); the prompt's prefill attends in the model's dtype. Matrix products cannot
read float8 operands here, and converting the cache for them would write it out again at every
step, so on a GPU the kernel below reads it as it is; on a CPU the grouped products take it
converted. Sampled tokens then come from a cache rounded to 3 mantissa bits, as with vLLM's:
training and scoring recompute log-probabilities in the model's dtype, and the importance ratio
sees the difference."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from vlmrl.training.trainer.attention import ROLLED, register_over_sdpa

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value; conversion past it gives NaN
KV_CACHE_DTYPES = ("auto", "fp8")  # train.kv_cache_dtype; "auto": the model's dtype
SDPA_BASED = ("sdpa", ROLLED)  # text attentions over transformers' SDPA


def stored(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as a cache of `dtype` keeps them (float8: clamped to its range)."""
    if dtype == FP8:
        return states.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return states.to(dtype)


class Fp8Layer(StaticLayer):
    """A StaticLayer whose keys and values are float8. A prefill (more than one token) attends in
    its own dtype, over the slots it wrote unrounded, as it does where rows share a prompt
    (`vlmrl.training.rollout.shared_prompts` prefills into a cache of the model's dtype)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states[..., :0, :].to(FP8),
                                    value_states[..., :0, :].to(FP8))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        first = int(self.cumulative_length) if new > 1 else 0  # a prefill's: not in the graph
        keys, values = super().update(stored(key_states, FP8), stored(value_states, FP8),
                                      *args, **kwargs)
        if new == 1:
            return keys, values
        slots = torch.arange(first, first + new, device=keys.device)
        return (keys.to(key_states.dtype).index_copy_(2, slots, key_states),
                values.to(value_states.dtype).index_copy_(2, slots, value_states))


def static_cache(config, max_cache_len: int, kv_cache_dtype: str = "auto") -> StaticCache:
    """transformers' StaticCache, its layers float8 where `kv_cache_dtype` is "fp8"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"params.yaml train.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                         f"not {kv_cache_dtype!r}")
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    if kv_cache_dtype == "fp8":
        if any(type(layer) is not StaticLayer for layer in cache.layers):
            raise ValueError("train.kv_cache_dtype fp8 serves full-attention layers only, not "
                             f"{sorted({type(layer).__name__ for layer in cache.layers})}")
        cache.layers = [Fp8Layer(max_cache_len=max_cache_len) for _ in cache.layers]
    return cache


@functools.cache  # one function per original: torch.compile's guards on it then hold
def grouped_decode_attention(original):
    """An attention function for one query token per row over the static cache: the query heads
    that share a key/value head are multiplied against it as one matrix, so the cache is read
    once per step (a float8 cache on a GPU by `cache_attention`). transformers' SDPA path with a
    mask first copies every key and value head `num_key_value_groups` times (`repeat_kv`): the
    whole cache written and read again per layer and step. Scores and softmax in float32.
    Anything else goes to `original`."""

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        batch, heads, length, dim = query.shape
        if (length != 1 or attention_mask is None or attention_mask.dtype != torch.bool
                or attention_mask.dim() != 4 or dropout):
            return original(module, query, key, value, attention_mask, dropout=dropout,
                            scaling=scaling, **kwargs)
        span = attention_mask.shape[-1]  # the part of the cache this step reads
        key, value = key[:, :, :span], value[:, :, :span]
        scale = dim ** -0.5 if scaling is None else scaling
        if key.dtype == FP8:
            if query.is_cuda:
                return cache_attention_op(query, key, value, attention_mask[:, 0, 0], scale), None
            key, value = key.to(query.dtype), value.to(query.dtype)
        kv_heads = key.shape[1]
        grouped = query.reshape(batch * kv_heads, heads // kv_heads, dim)
        keys = key.reshape(batch * kv_heads, span, dim).transpose(1, 2)
        if grouped.is_cuda:
            scores = torch.bmm(grouped, keys, out_dtype=torch.float32)
        else:
            scores = torch.bmm(grouped.float(), keys.float())
        scores = scores.view(batch, kv_heads, heads // kv_heads, -1)
        scores = scores * scale
        probs = scores.masked_fill(~attention_mask, -float("inf")).softmax(-1).to(value.dtype)
        out = torch.bmm(probs.view(batch * kv_heads, heads // kv_heads, -1),
                        value.reshape(batch * kv_heads, span, dim))
        return out.view(batch, 1, heads, dim), None

    return attend


GROUPED = "vlmrl_grouped_decode"  # the name `grouped_decode_attention` is registered under


@functools.cache
def grouped_attention_name() -> str:
    """`grouped_decode_attention` registered over transformers' SDPA; its name."""
    return register_over_sdpa(GROUPED, grouped_decode_attention)


def generative_model(model):
    """The transformers model under a PEFT wrapper (the one with generate's helpers)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def attention_implementation(model) -> str | None:
    """The text model's attention ("sdpa", "eager", "flash_attention_2", ...)."""
    config = generative_model(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation",
                                                                   None)


def set_text_attention(model, name: str) -> None:
    """Sets the attention implementation of the model's language model alone (a vision tower
    keeps its own) through transformers' `set_attn_implementation`, and fails where the model
    did not take it (transformers only warns)."""
    hf_model = generative_model(model)
    config = hf_model.config
    text = config.get_text_config()
    keys = [key for key in getattr(config, "sub_configs", {}) if getattr(config, key) is text]
    hf_model.set_attn_implementation({keys[0]: name} if keys and text is not config else name)
    if attention_implementation(model) != name:
        raise RuntimeError(f"{type(hf_model).__name__} did not take the attention implementation "
                           f"{name!r} (graph decoding's attention: train.graph_decoding)")


@contextlib.contextmanager
def decode_attention(model, mode: str) -> Iterator[None]:
    """While active, the model's language model attends with `grouped_decode_attention` (mode
    "grouped") where its attention is SDPA-based; mode "model", or any other attention, leaves it
    alone. On exit its attention implementation is set back."""
    if mode not in ("grouped", "model"):
        raise ValueError(f"graph decoding attention must be 'grouped' or 'model', not {mode!r}")
    saved = attention_implementation(model)
    if mode == "model" or saved not in SDPA_BASED:
        yield
        return
    set_text_attention(model, grouped_attention_name())
    try:
        yield
    finally:
        set_text_attention(model, saved)


# The kernel (commit 7c1170f measured it no faster than the grouped products on a bf16 cache):
# each program keeps a running softmax over its share of the slots for the query heads of one
# key/value head (flash-decoding; its products on tensor cores, the heads padded to 16 and the
# float8 values widened to the query's dtype in registers). A row's slots are read from its first
# slot the mask reads to its last (left padding and the empty slots past the step are not read),
# in a loop over those bounds with no branch inside, which Triton pipelines. Slots inside the
# bounds that the mask leaves out are scored -inf. With one share per (row, key/value head) the
# program writes the output itself; with several, a second launch merges them. float32 inside,
# the output rounded once to the query's dtype. A row that reads no slot gets NaN (generation's
# rows read at least the slot the step writes).
BLOCK_SLOTS = 64
SPLITS = 1  # shares of a row's slots per (row, key/value head); 1: no merge launch
STAGES = 3  # Triton's software pipeline depth of the slot loop


@functools.cache
def _kernels():
    import triton

    from vlmrl.training.rollout import attention_kernels

    return triton, attention_kernels


def cache_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     read: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of query [rows, heads, 1, dim] over the cache's key and value
    [rows, kv_heads, slots, dim] where `read` [rows, length] (bool, length <= slots) is true;
    returns [rows, 1, heads, dim] in the query's dtype."""
    triton, kernels = _kernels()
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    g_pad = max(16, triton.next_power_of_2(group))  # tl.dot's least rows
    length = read.shape[-1]
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    read = read if read.stride(-1) == 1 else read.contiguous()
    out = torch.empty(rows, 1, heads, dim, dtype=query.dtype, device=query.device)
    shares = rows * kv_heads * SPLITS * g_pad if SPLITS > 1 else 0
    maxima = torch.empty(shares, dtype=torch.float32, device=query.device)
    totals = torch.empty(shares, dtype=torch.float32, device=query.device)
    acc = torch.empty(shares, dim, dtype=torch.float32, device=query.device)
    kernels.partial_attention[(rows * kv_heads, SPLITS)](
        query, key, value, read, maxima, totals, acc, out, length, float(scale),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), read.stride(0), out.stride(0),
        out.stride(2), KV_HEADS=kv_heads, GROUP=group, G_PAD=g_pad, DIM=dim, BLOCK=BLOCK_SLOTS,
        SPLITS=SPLITS, LENGTH_PAD=triton.next_power_of_2(length), WHILE=kernels.INTERPRETED,
        num_warps=4, num_stages=STAGES)
    if SPLITS > 1:
        kernels.merge_shares[(rows * kv_heads,)](
            maxima, totals, acc, out, out.stride(0), out.stride(2), KV_HEADS=kv_heads,
            GROUP=group, G_PAD=g_pad, DIM=dim, SPLITS=SPLITS, num_warps=4)
    return out


@torch.library.custom_op("vlmrl::cache_attention", mutates_args=())
def cache_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        read: torch.Tensor, scale: float) -> torch.Tensor:
    """`cache_attention` as one operator, which torch.compile calls as it is and a CUDA graph
    captures."""
    return cache_attention(query, key, value, read, scale)


@cache_attention_op.register_fake
def _(query, key, value, read, scale):
    rows, heads, _, dim = query.shape
    return query.new_empty(rows, 1, heads, dim)
