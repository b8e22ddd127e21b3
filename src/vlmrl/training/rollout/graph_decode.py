"""Rollouts near the memory-bandwidth bound. Decoding one token of a 2B model reads
every weight once, so a decode step should take about (bytes of weights) / (memory bandwidth);
transformers' `generate` spends most of a step elsewhere: Python per step (input preparation,
the 4D mask, the logits processors, stopping criteria) and the sampling kernels, launched one by
one between the compiled forward passes. Here the whole decode step, forward pass and sampling
together, is one CUDA graph replayed once per token: the prompt is prefilled by the model's own
forward (vision tower and multimodal RoPE as in `generate`), then each replay reads the last
token, position and mask from fixed buffers, writes the static KV cache, draws the next token
and advances the position, with no host synchronisation but one check for finished rows every
`CHECK_EVERY` steps (the early exit: the call returns once every row has sampled EOS). Where
`disable_compile` is false the step's forward runs under torch.compile inside the graph, which
fuses the small elementwise kernels between the projections; rows that repeat a prompt share its
prefill (`vlmrl.training.rollout.shared_prompts`).

The draw samples exactly transformers' distribution for TRL's settings (suppressed tokens
removed, temperature, top-k, then top-p over what top-k kept: `vlmrl.models.sampling`'s
`candidate_probs`), by the Gumbel-max trick (`argmax(log p - log(-log u))`), which needs no
`torch.multinomial` (it cannot be captured). Greedy decoding (TRL's `do_sample=False`) takes the
argmax of the logits. One graph (and one static cache) is kept per (rows, cache length, greedy):
the cache's size is the generation batch's, so `train.max_generation_rows` still bounds memory.
Where a setting is not served (beam search, repetition penalty, min-p, returned scores, a model
on a CPU, a prompt longer than the cache), `generate` is transformers' own."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrl.models.sampling import SamplingSettings, candidate_probs
from vlmrl.training.rollout.decode_attention import (
    SDPA_BASED,
    attention_implementation,
    decode_attention,
    generative_model,
    static_cache,
)
from vlmrl.training.rollout.generation import rollout_model
from vlmrl.training.rollout.shared_prompts import copy_into_static, distinct_rows, select_rows

CHECK_EVERY = 64  # decode steps between host checks for "every row has finished"
CACHE_ROUND = 256  # cache lengths are rounded up to this, so prompts of other lengths reuse one
SPAN_ROUND = 256  # with spans, grouped attention reads the cache up to the written slot rounded up


@dataclass(frozen=True)
class DecodePlan:
    """What one graph serves: the batch shape and the draw."""

    rows: int
    cache_len: int
    sampling: SamplingSettings | None  # None: greedy


def served(config, kwargs: dict[str, Any]) -> bool:
    """Whether a `generate` call with this GenerationConfig and these keyword arguments takes
    the graph path."""
    unsupported = (
        (config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1
        or (config.repetition_penalty not in (None, 1.0)) or config.min_p
        or config.return_dict_in_generate or config.output_scores or config.output_logits
        or kwargs.get("logits_processor") or kwargs.get("stopping_criteria")
        or kwargs.get("streamer") or kwargs.get("past_key_values") is not None
        or kwargs.get("inputs_embeds") is not None)
    return not unsupported


def plan_for(config, rows: int, prompt_len: int, suppress: tuple[int, ...]) -> DecodePlan:
    needed = prompt_len + int(config.max_new_tokens)
    cache_len = int(getattr(config, "max_cache_len", None) or 0)  # the params' size, if it fits
    if cache_len < needed:
        cache_len = (needed + CACHE_ROUND - 1) // CACHE_ROUND * CACHE_ROUND
    sampling = None
    if config.do_sample:
        top_k = int(config.top_k or 0)
        sampling = SamplingSettings(temperature=float(config.temperature or 1.0),
                                    top_k=top_k if top_k > 0 else 1 << 30,
                                    top_p=1.0 if config.top_p is None else float(config.top_p),
                                    suppress=suppress)
    return DecodePlan(rows=rows, cache_len=cache_len, sampling=sampling)


def sample_next(logits: torch.Tensor, sampling: SamplingSettings | None,
                suppress: torch.Tensor | None) -> torch.Tensor:
    """One token per row from [rows, vocab] logits, with no host synchronisation. The logits
    stay in the model's dtype: casting to float32 is exact and keeps their order, so the argmax
    and the top k are those of the float32 logits, and only the k values are cast (a radix
    top-k over 16-bit keys takes half the passes of one over 32-bit keys)."""
    if suppress is not None and suppress.numel():
        logits = logits.index_fill(1, suppress, -float("inf"))
    if sampling is None:
        return logits.argmax(-1)
    ids, probs = candidate_probs(logits, sampling)
    uniform = torch.rand(probs.shape, device=probs.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(uniform.clamp_(1e-20, 1.0 - 1e-7)))
    choice = (probs.log() + gumbel).argmax(-1, keepdim=True)  # log(0) = -inf: never drawn
    return ids.gather(1, choice).squeeze(1)


class MergedLoRA:
    """bf16 copies of the LoRA-adapted weights with the adapter folded in (W + s B A), for the
    decode graph only: a decode step then runs one matrix product per projection instead of
    seven kernels (casts to the adapter's float32, A, B, scale, add), which at a few rows per
    step cost more than the weights' bytes. Costs one copy of the adapted weights' memory; the
    copies are refreshed from the trained adapter at every generate call (`refresh`), and the
    graph is captured with the adapter switched off and the copies in place of the weights
    (`swapped`). Sampled tokens then come from the merged weights rounded to bf16, as they would
    from a vLLM copy; training and scoring use the adapter itself. Not for quantized weights."""

    def __init__(self, model) -> None:
        self.model = model
        self.layers = [module for module in model.modules()
                       if hasattr(module, "lora_A") and hasattr(module, "base_layer")
                       and module.active_adapters and not module.disable_adapters]
        if not self.layers:
            raise ValueError("graph decoding with merged weights needs a model with an active "
                             "LoRA adapter")
        for layer in self.layers:
            if layer.base_layer.weight.dtype not in (torch.bfloat16, torch.float16):
                raise ValueError("graph decoding with merged weights needs 16-bit base weights "
                                 f"(model.load_in_4bit: false), not {layer.base_layer.weight.dtype}")
        self.copies = [torch.empty_like(layer.base_layer.weight) for layer in self.layers]

    @torch.no_grad()
    def refresh(self) -> None:
        for layer, copy in zip(self.layers, self.copies):
            weight = layer.base_layer.weight.float()
            for name in layer.active_adapters:
                weight += layer.get_delta_weight(name).float()
            copy.copy_(weight)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        originals = [layer.base_layer.weight.data for layer in self.layers]
        for layer, copy in zip(self.layers, self.copies):
            layer.base_layer.weight.data = copy
        try:
            with self.model.disable_adapter():
                yield
        finally:
            for layer, original in zip(self.layers, originals):
                layer.base_layer.weight.data = original


class GraphDecoder:
    """The decode loop for one DecodePlan: static buffers, one static cache, one CUDA graph."""

    def __init__(self, model, plan: DecodePlan, device: torch.device, eos: list[int],
                 pad: int, suppress: tuple[int, ...], use_graph: bool = True,
                 attention: str = "grouped", merged: bool = False, nf4=None,
                 forward=None, share_prompts: bool = True, spans: bool = False,
                 kv_cache_dtype: str = "auto", pool=None) -> None:
        self.model, self.plan, self.use_graph, self.attention = model, plan, use_graph, attention
        self.forward = model if forward is None else forward  # the model, or it compiled
        self.share_prompts, self.spans = share_prompts, spans
        # eager attention adds its mask to the scores: 0 where a slot is read, the lowest float
        self.additive_mask = attention_implementation(model) == "eager"
        if kv_cache_dtype == "fp8" and (attention != "grouped" or self.additive_mask):
            raise ValueError("train.kv_cache_dtype fp8 needs the grouped attention of an sdpa model")
        self.dtype = model.dtype
        self.nf4 = nf4  # an NF4Decode, or None: bitsandbytes' and PEFT's own projections
        rows, length = plan.rows, plan.cache_len
        self.cache = static_cache(model.config, length, kv_cache_dtype)
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        multimodal_rope = _rope_deltas_holder(generative_model(model)) is not None
        self.positions = torch.zeros(*((4,) if multimodal_rope else ()), rows, 1,
                                     dtype=torch.long, device=device)
        self.valid = torch.ones(rows, length, dtype=torch.bool, device=device)
        self.index = torch.zeros((), dtype=torch.long, device=device)  # cache slot being written
        self.slots = torch.arange(length, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.eos = torch.tensor(eos or [-1], dtype=torch.long, device=device)
        self.pad = pad
        self.suppress = torch.tensor(suppress, dtype=torch.long, device=device) if suppress else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # per span of the cache read
        self.pool = pool  # the graphs' memory pool (a handle), shared: they never run at once
        self.merged = MergedLoRA(model) if merged and use_graph else None

    # -- the step, replayed

    def step(self, span: int) -> None:
        mask = (self.valid[:, :span] & (self.slots[:span] <= self.index))[:, None, None, :]
        if self.additive_mask:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(self.dtype).min)
        if self.spans and self.forward is not self.model:
            torch._dynamo.maybe_mark_dynamic(mask, 3)  # one trace for every span
        out = self.forward(input_ids=self.token, attention_mask=mask, position_ids=self.positions,
                           past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        chosen = sample_next(out.logits[:, -1], self.plan.sampling, self.suppress)
        chosen = torch.where(self.finished, torch.full_like(chosen, self.pad), chosen)
        self.finished |= torch.isin(chosen, self.eos)
        self.token.copy_(chosen[:, None])
        self.positions.add_(1)
        self.index.add_(1)

    def span(self, slot: int) -> int:
        """How much of the cache a step writing `slot` reads: with `spans` and the grouped
        attention the filled part rounded up to SPAN_ROUND (one graph per span, which raised the
        "graph" profile's peak), else all of it."""
        if not self.spans or self.attention != "grouped":
            return self.plan.cache_len
        return min(self.plan.cache_len, (slot // SPAN_ROUND + 1) * SPAN_ROUND)

    def _run_step(self, span: int) -> None:
        graph = self.graphs.get(span)
        capturing = graph is None
        swapped = self.merged.swapped() if self.merged and capturing else contextlib.nullcontext()
        kernel = self.nf4.active() if self.nf4 and capturing else contextlib.nullcontext()
        with swapped, kernel:
            if not self.use_graph:
                self.step(span)
            elif graph is None:
                with side_stream():
                    self.step(span)  # this step, run: warms up cuBLAS and the allocator
                # the next steps, captured (not run) and replayed from now on
                graph = self.graphs[span] = capture(lambda: self.step(span), self.pool)
                self.pool = graph.pool()
            else:
                graph.replay()

    # -- one generate call

    def prefill(self, input_ids, attention_mask, model_kwargs: dict[str, Any]) -> torch.Tensor:
        """Runs the prompt through the model into the cache, each distinct prompt once where the
        rows repeat (`vlmrl.training.rollout.shared_prompts`), with the position ids `generate` gives it
        (multimodal RoPE for Qwen-VL); returns the first drawn tokens."""
        from transformers import DynamicCache

        self.cache.reset()
        prompt_len = input_ids.shape[1]
        hf_model = generative_model(self.model)
        vision_start = getattr(hf_model.config, "vision_start_token_id", None)
        shared = distinct_rows(input_ids, model_kwargs, vision_start) if self.share_prompts \
            else None
        inverse = None  # each row's index among the distinct prompts, where they repeat
        if shared is None:
            logits = self._prefill(input_ids, attention_mask, model_kwargs, self.cache)
        else:
            keep, inverse = shared
            small = DynamicCache()
            logits = self._prefill(*select_rows(keep, input_ids, attention_mask, model_kwargs,
                                                vision_start), small)[inverse]
            copy_into_static(small, self.cache, inverse, prompt_len)
        deltas = _rope_deltas(hf_model)
        if deltas is not None and inverse is not None:
            deltas = deltas.to(inverse.device)[inverse]
        text = attention_mask.long().sum(-1, keepdim=True)  # the next token's text position
        if self.positions.dim() == 3:  # [text; temporal, height, width] as Qwen-VL decodes
            shifted = text + (deltas.to(text.device).reshape(-1, 1) if deltas is not None else 0)
            self.positions.copy_(torch.stack([text, shifted, shifted, shifted]))
        else:
            self.positions.copy_(text)
        self.valid.fill_(True)
        self.valid[:, :prompt_len].copy_(attention_mask.bool())
        self.index.fill_(prompt_len)
        self.finished.zero_()
        first = sample_next(logits, self.plan.sampling, self.suppress)
        self.finished |= torch.isin(first, self.eos)
        self.token.copy_(first[:, None])
        return first

    def _prefill(self, input_ids, attention_mask, model_kwargs, cache) -> torch.Tensor:
        """The last position's float32 logits of a prefill of these rows into `cache`."""
        positions = generative_model(self.model)._prepare_position_ids_for_generation(
            input_ids, {"attention_mask": attention_mask, "input_ids": input_ids, **model_kwargs})
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=positions, past_key_values=cache, use_cache=True,
                         logits_to_keep=1, **model_kwargs)
        return out.logits[:, -1].float()

    def generate(self, input_ids, attention_mask, max_new_tokens: int,
                 model_kwargs: dict[str, Any]) -> torch.Tensor:
        tokens = torch.full((input_ids.shape[0], max_new_tokens), self.pad, dtype=torch.long,
                            device=input_ids.device)
        tokens[:, 0] = self.prefill(input_ids, attention_mask, model_kwargs)
        prompt_len = input_ids.shape[1]
        if self.merged is not None:
            self.merged.refresh()  # the adapter as trained so far, folded into the copies
        made = 1
        with decode_attention(self.model, self.attention):
            while made < max_new_tokens:
                if made % CHECK_EVERY == 0 and bool(self.finished.all()):
                    break
                self._run_step(self.span(prompt_len + made - 1))
                tokens[:, made] = self.token[:, 0]
                made += 1
        return torch.cat([input_ids, tokens[:, :made]], dim=1)


@contextlib.contextmanager
def side_stream() -> Iterator[None]:
    """Work on a new stream that starts after, and is waited for by, the current one (a
    capture cannot run on the default stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


def capture(step, pool=None) -> torch.cuda.CUDAGraph:
    """`step`'s kernels captured into a CUDA graph whose memory comes from `pool` (a graph's
    `pool()`; None: a new pool). `torch.cuda.graph` empties the allocator's caches (device
    and pinned host) before each capture, and the "graph" mode captures at every generate
    call: the blocks the training phases had cached went back to the driver each time, to be
    allocated again."""
    graph = torch.cuda.CUDAGraph()
    with side_stream():
        graph.capture_begin(pool=pool)
        try:
            step()
        finally:
            graph.capture_end()
    return graph


def _rope_deltas_holder(model):
    """The module that keeps Qwen-VL's multimodal RoPE offsets (`rope_deltas`), or None."""
    inner = getattr(model, "model", None)
    return inner if inner is not None and hasattr(inner, "rope_deltas") else None


def _rope_deltas(model) -> torch.Tensor | None:
    holder = _rope_deltas_holder(model)
    return None if holder is None else holder.rope_deltas


@dataclass
class GraphDecoding:
    """The policy's `generate` during training (`install_graph_decoding`): graph decoding where
    served, transformers' (`original`) otherwise."""

    model: Any
    original: Any
    use_graph: bool = True
    attention: str = "grouped"  # or "model": the model's own (SDPA) attention in decode steps
    merged: bool = False  # decode with bf16 copies of the weights with the adapter folded in
    keep: bool = True  # keep each batch shape's cache and graph between calls (else freed)
    share_prompts: bool = True  # prefill each distinct prompt once (vlmrl.training.rollout.shared_prompts)
    spans: bool = False  # attention over the filled span of the cache (GraphDecoder.span)
    kv_cache_dtype: str = "auto"  # or "fp8": vlmrl.training.rollout.decode_attention
    # NF4 projections by `vlmrl.training.rollout.nf4_decode` in decode steps; VLMRL_NF4_DECODE=0: off
    nf4_kernel: bool = field(default_factory=lambda: os.environ.get("VLMRL_NF4_DECODE") != "0")
    decoders: dict | None = None
    anchor: Any = None  # the graph that keeps the decoders' memory pool live (`graph_pool`)
    calls: int = 0
    decoder_class: type = GraphDecoder  # a subclass times its phases (benchmarks/decode_profile.py)

    def __call__(self, *args: Any, generation_config=None, **kwargs: Any):
        config = generation_config if generation_config is not None else \
            self.model.generation_config
        input_ids = kwargs.get("input_ids")
        if (args or input_ids is None or input_ids.device.type != "cuda"
                or not served(config, kwargs)
                or attention_implementation(self.model) not in (*SDPA_BASED, "eager")):
            return self.original(*args, generation_config=generation_config, **kwargs)
        self.calls += 1
        return self._decode(config, kwargs)

    def _decoder_for(self, plan: DecodePlan) -> GraphDecoder | None:
        """A decoder of the same rows and draw whose cache is long enough; one whose cache is
        too short is dropped (its memory freed), so one decoder per batch shape is kept."""
        self.decoders = self.decoders if self.decoders is not None else {}
        for kept, decoder in list(self.decoders.items()):
            if (kept.rows, kept.sampling) == (plan.rows, plan.sampling):
                if kept.cache_len >= plan.cache_len:
                    return decoder
                del self.decoders[kept]
        return None

    def graph_pool(self, use_graph: bool, device: torch.device):
        """The memory pool of every decoder's graphs, or None without graphs: that of a
        one-kernel graph kept for the purpose, so that the pool stays live between calls and
        each call's capture reuses its blocks (torch's allocators refuse to share a pool again
        once every graph in it is gone, and a new pool per call would leave each call's blocks
        reserved)."""
        if not use_graph:
            return None
        if self.anchor is None:  # the graph and the tensor its one kernel writes
            counter = torch.zeros(1, device=device)
            self.anchor = (capture(lambda: counter.add_(1)), counter)
        return self.anchor[0].pool()

    @functools.cached_property
    def compiled(self):
        """The model's forward pass under torch.compile, for decode steps: one trace per batch
        shape, and the elementwise work between projections (norms, RoPE, residuals, the
        attention's scale and mask) fused into a few kernels."""
        return torch.compile(self.model, dynamic=False)

    @functools.cached_property
    def nf4(self):
        """The model's NF4Decode, made once (it keeps the block scales), or None."""
        from vlmrl.training.rollout.nf4_decode import kernel_available
        from vlmrl.training.rollout.nf4_projections import NF4Decode

        if not self.nf4_kernel or self.merged or not kernel_available():
            return None
        return NF4Decode(self.model) or None

    def _decode(self, config, kwargs: dict[str, Any]) -> torch.Tensor:
        """prompt + completion ids, [rows, prompt + new tokens], as `generate` returns them."""
        kwargs = dict(kwargs)
        input_ids = kwargs.pop("input_ids")
        attention_mask = kwargs.pop("attention_mask", None)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        for key in ("disable_compile", "use_cache"):
            kwargs.pop(key, None)
        suppress = tuple(int(i) for i in (config.suppress_tokens or ()))
        plan = plan_for(config, input_ids.shape[0], input_ids.shape[1], suppress)
        decoder = self._decoder_for(plan)
        if decoder is None:
            eos = config.eos_token_id
            eos = [eos] if isinstance(eos, int) else list(eos or [])
            pad = config.pad_token_id if config.pad_token_id is not None else (eos or [0])[0]
            use_graph = self.use_graph and input_ids.device.type == "cuda"
            compiled = use_graph and config.disable_compile is False  # as transformers' rule
            decoder = self.decoders[plan] = self.decoder_class(
                self.model, plan, input_ids.device, eos, int(pad), suppress, use_graph,
                self.attention, self.merged, self.nf4, self.compiled if compiled else None,
                self.share_prompts, self.spans, self.kv_cache_dtype,
                self.graph_pool(use_graph, input_ids.device))
        with torch.no_grad():
            out = decoder.generate(input_ids, attention_mask, int(config.max_new_tokens), kwargs)
        if not self.keep:  # the cache back to the allocator, the graph's blocks to the pool
            self.decoders.clear()
        return out


MODES = ("eager", "graph", "merged")


def install_graph_decoding(model, mode: str = "graph", attention: str = "grouped",
                           kv_cache_dtype: str = "auto") -> GraphDecoding:
    """Routes the policy's `generate` (the call TRL makes on the PEFT model reaches the
    transformers model under it, loaded with `vlmrl.training.rollout.generation.rollout_class`) to graph
    decoding. `mode` (train.graph_decoding): "graph", the adapter as it is, cache and graph freed
    after each call (memory as transformers' generate); "merged", `MergedLoRA` copies, cache and
    graphs kept and attention over the filled span of the cache (speed, at one more copy of the
    adapted weights). Both compile the decode step's forward where `disable_compile` is false;
    `kv_cache_dtype` (train.kv_cache_dtype) "fp8" keeps the cache in 8 bits
    (`vlmrl.training.rollout.decode_attention`)."""
    if mode not in MODES[1:]:
        raise ValueError(f"params.yaml train.graph_decoding must be one of {MODES}, not {mode!r}")
    inner = rollout_model(model)
    wrapper = GraphDecoding(model=model, original=inner.transformers_generate,
                            attention=attention, merged=mode == "merged", keep=mode == "merged",
                            spans=mode == "merged", kv_cache_dtype=kv_cache_dtype)
    inner.set_rollout_generate(wrapper)
    return wrapper
