"""The decode loop of `vlmrl.training.rollout.graph_decode` (the GPU rollout path) run eagerly on a
CPU: under greedy decoding it must produce exactly transformers' `generate` tokens, with left
padding, images (multimodal RoPE) and text-only models; its draw must carry the warpers'
distribution; what it does not serve must fall back to transformers."""

from __future__ import annotations

import contextlib

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

from vlmrl.models.embedded import ensure_embedded_model
from vlmrl.models.loading import checkpoint_class
from vlmrl.models.processor import load_processor
from vlmrl.models.sampling import SamplingSettings, candidate_probs
from vlmrl.training.rollout import graph_decode
from vlmrl.training.rollout.decode_attention import grouped_decode_attention
from vlmrl.training.rollout.generation import rollout_class
from vlmrl.training.rollout.graph_decode import (
    GraphDecoder,
    GraphDecoding,
    install_graph_decoding,
    sample_next,
    served,
)
from vlmrl.training.rollout.shared_prompts import distinct_rows


def vl_inputs(processor, questions: list[str]) -> dict:
    texts = [processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
        add_generation_prompt=True, tokenize=False) for q in questions]
    images = [Image.new("RGB", (64 + 32 * i, 64), (40 * i, 90, 200)) for i in range(len(texts))]
    processor.tokenizer.padding_side = "left"
    return dict(processor(text=texts, images=images, return_tensors="pt", padding=True))


def greedy_config(model, new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            eos_token_id=model.generation_config.eos_token_id,
                            pad_token_id=model.generation_config.pad_token_id)


@pytest.fixture(scope="module")
def vl_model():
    path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, load_processor(str(path))


def test_greedy_tokens_equal_generate_with_images_and_left_padding(vl_model) -> None:
    model, processor = vl_model
    inputs = vl_inputs(processor, ["What is 2 + 2?", "Name the largest value in the chart now."])
    assert (inputs["attention_mask"] == 0).any(), "the prompts must differ in length (padding)"
    config = GenerationConfig(max_new_tokens=12, do_sample=False,
                              eos_token_id=-5, pad_token_id=0)  # no EOS: all 12 steps run
    with torch.no_grad():
        expected = model.generate(**inputs, generation_config=config)
        ours = GraphDecoding(model=model, original=model.generate, use_graph=False,
                             attention="model")
        got = ours._decode(config, dict(inputs))
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


def test_eager_attention_gets_an_additive_mask(monkeypatch) -> None:
    """transformers' eager attention adds the mask to the scores, so a bool mask would add 1 and
    0 (the tiny model's tokens barely notice); the decode step must give it 0 and the lowest
    float: every step's logits equal generate's."""
    path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()
    processor = load_processor(str(path))
    inputs = vl_inputs(processor, ["What is 2 + 2?", "Name the largest value in the chart now."])
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-5, pad_token_id=0)
    seen = []
    original = graph_decode.sample_next

    def recording(logits, *args):
        seen.append(logits.clone())
        return original(logits, *args)

    monkeypatch.setattr(graph_decode, "sample_next", recording)
    with torch.no_grad():
        expected = model.generate(**inputs, generation_config=config, output_logits=True,
                                  return_dict_in_generate=True)
        GraphDecoding(model=model, original=model.generate, use_graph=False,
                      attention="model")._decode(config, dict(inputs))
    assert len(seen) == len(expected.logits) == 6
    for ours, theirs in zip(seen, expected.logits):
        assert torch.allclose(ours, theirs.float(), atol=1e-4, rtol=1e-4)


def test_text_model_greedy_tokens_equal_generate() -> None:
    path = ensure_embedded_model("embedded:tiny-qwen3", seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = load_processor(str(path))
    tokenizer.padding_side = "left"
    inputs = dict(tokenizer(["Two plus two is", "The answer to the long question is"],
                            return_tensors="pt", padding=True))
    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-5, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(**inputs, generation_config=config)
        got = GraphDecoding(model=model, original=model.generate, use_graph=False,
                             attention="model")._decode(
            config, dict(inputs))
    assert torch.equal(got, expected)


def test_rows_stop_at_eos_and_pad_after_it(vl_model) -> None:
    model, processor = vl_model
    inputs = vl_inputs(processor, ["a", "bb"])
    with torch.no_grad():
        free = GraphDecoding(model=model, original=model.generate, use_graph=False,
                             attention="model")._decode(
            GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-5, pad_token_id=0),
            dict(inputs))
    prompt = inputs["input_ids"].shape[1]
    eos = int(free[0, prompt + 2])  # make row 0's third token the EOS
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=7)
    with torch.no_grad():
        expected = model.generate(**inputs, generation_config=config)
        got = GraphDecoding(model=model, original=model.generate, use_graph=False,
                             attention="model")._decode(
            config, dict(inputs))
    width = min(got.shape[1], expected.shape[1])
    assert torch.equal(got[:, :width], expected[:, :width])
    assert (got[0, prompt + 3:] == 7).all()


def test_repeated_prompts_are_prefilled_once_and_decode_as_generate(vl_model,
                                                                   monkeypatch) -> None:
    """Rows 0 and 1 repeat one prompt (text and image), rows 2 and 4 another; row 3 has row 0's
    text with row 2's image, so it is a prompt of its own."""
    model, processor = vl_model
    questions, sizes = ["What is 2 + 2?", "Name the largest value in the chart now."], [64, 96]
    picked = [(0, 0), (0, 0), (1, 1), (0, 1), (1, 1)]
    texts = [processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": questions[q]}]}],
        add_generation_prompt=True, tokenize=False) for q, _ in picked]
    images = [Image.new("RGB", (sizes[i], 64), (40 * i, 90, 200)) for _, i in picked]
    processor.tokenizer.padding_side = "left"
    inputs = dict(processor(text=texts, images=images, return_tensors="pt", padding=True))
    prefilled = []
    original = GraphDecoder._prefill

    def recording(self, input_ids, *args):
        prefilled.append(input_ids.shape[0])
        return original(self, input_ids, *args)

    monkeypatch.setattr(GraphDecoder, "_prefill", recording)
    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-5, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(**inputs, generation_config=config)
        got = GraphDecoding(model=model, original=model.generate, use_graph=False,
                            attention="model")._decode(config, dict(inputs))
    assert prefilled == [3]
    assert torch.equal(got, expected)


def test_distinct_rows_declines_what_it_cannot_tell_apart() -> None:
    ids = torch.tensor([[5, 6], [5, 6]])
    keep, inverse = distinct_rows(ids, {}, None)
    assert keep == [0] and inverse.tolist() == [0, 0]
    assert distinct_rows(ids, {"pixel_values_videos": torch.zeros(2, 3)}, 1) is None
    assert distinct_rows(ids, {"pixel_values": torch.zeros(2, 3)}, None) is None
    assert distinct_rows(torch.tensor([[5, 6], [5, 7]]), {}, None) is None


def test_compiled_step_reads_growing_spans_of_the_cache_from_one_trace(vl_model,
                                                                       monkeypatch) -> None:
    """The decode step's forward under torch.compile, with spans of 8 slots: 30 tokens cross
    several spans (a new mask length each) and must still be traced once and decode as the
    eager step."""
    from torch._dynamo.utils import counters

    model, processor = vl_model
    monkeypatch.setattr(graph_decode, "SPAN_ROUND", 8)
    inputs = vl_inputs(processor, ["What is 2 + 2?", "Name the largest value in the chart now."])
    config = GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=-5, pad_token_id=0)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    rest = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    plan = graph_decode.plan_for(config, ids.shape[0], ids.shape[1], ())

    def decoder(forward):
        return GraphDecoder(model, plan, ids.device, [-5], 0, (), use_graph=False,
                            attention="grouped", forward=forward, spans=True)

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        eager = decoder(None).generate(ids, mask, 30, dict(rest))
        compiled = torch.compile(model)
        got = decoder(compiled).generate(ids, mask, 30, dict(rest))
        again = decoder(compiled).generate(ids, mask, 30, dict(rest))
    assert len({decoder(None).span(slot) for slot in range(ids.shape[1], ids.shape[1] + 30)}) > 2
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(got, eager) and torch.equal(again, eager)


def test_draw_carries_the_warpers_distribution() -> None:
    settings = SamplingSettings(temperature=0.9, top_k=20, top_p=0.8)
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)) * 2
    torch.manual_seed(0)
    drawn = sample_next(logits.repeat(40_000, 1), settings, torch.tensor([int(logits.argmax())]))
    ids, probs = candidate_probs(logits.index_fill(1, logits.argmax(-1), -float("inf")), settings)
    observed = torch.bincount(drawn, minlength=300).float() / 40_000
    assert int(logits.argmax()) not in drawn.tolist()
    assert torch.allclose(observed[ids[0]], probs[0], atol=0.01)


@pytest.mark.parametrize("sampling", [SamplingSettings(temperature=0.7, top_k=20, top_p=0.8),
                                      None])
def test_draw_from_bf16_logits_is_the_draw_from_their_float32_values(sampling) -> None:
    """The decode step hands `sample_next` the model's bf16 logits: with the same random
    numbers it must draw what it draws from their float32 values (suppression included)."""
    order = torch.randperm(300, generator=torch.Generator().manual_seed(4))
    logits = ((order - 150).float() / 8).repeat(64, 1)  # distinct, exact in bf16
    suppress = torch.tensor([int(logits[0].argmax()), 7])
    draws = []
    for values in (logits.bfloat16(), logits):
        torch.manual_seed(0)
        draws.append(sample_next(values, sampling, suppress))
    assert torch.equal(draws[0], draws[1])
    assert not torch.isin(draws[0], suppress).any()
    if sampling is None:  # the largest logit once the suppressed ones are out
        assert torch.equal(draws[0], logits.index_fill(1, suppress, -1e9).argmax(-1))
    else:
        assert len(set(draws[0].tolist())) > 1


def test_unserved_settings_and_cpu_models_use_transformers(vl_model) -> None:
    model, processor = vl_model
    assert not served(GenerationConfig(num_beams=2), {})
    assert not served(GenerationConfig(repetition_penalty=1.1), {})
    assert served(GenerationConfig(do_sample=True, top_k=20, top_p=0.8), {})
    inputs = vl_inputs(processor, ["x"])
    with pytest.raises(TypeError, match="not loaded for rollouts"):
        install_graph_decoding(model)
    path = ensure_embedded_model("embedded:tiny-qwen3-vl", seed=0)
    model = rollout_class(checkpoint_class(str(path))).from_pretrained(
        str(path), dtype=torch.float32).eval()
    wrapper = install_graph_decoding(model)
    with torch.no_grad():
        model.generate(**inputs, generation_config=greedy_config(model, 3))
    assert wrapper.calls == 0  # a CPU model: transformers' generate


def test_grouped_attention_equals_sdpa_with_padding_mask() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module:
        num_key_value_groups = 4
        is_causal = True

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 8, 1, 16, generator=generator)
    key, value = (torch.randn(3, 2, 40, 16, generator=generator) for _ in range(2))
    mask = torch.ones(3, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :7] = False  # left padding
    mask[..., 30:] = False  # cache slots not written yet
    expected, _ = sdpa_attention_forward(Module(), query, key, value, mask, scaling=0.25)
    got, _ = grouped_decode_attention(sdpa_attention_forward)(Module(), query, key, value, mask,
                                                              scaling=0.25)
    assert got.shape == expected.shape == (3, 1, 8, 16)
    assert torch.allclose(got, expected, atol=1e-5)


def test_merged_copies_fold_the_adapter_in_and_follow_it() -> None:
    from peft import LoraConfig, get_peft_model

    from vlmrl.training.rollout.graph_decode import MergedLoRA

    path = ensure_embedded_model("embedded:tiny-qwen3", seed=0)
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    merged = MergedLoRA(model)
    assert len(merged.layers) == 4  # q_proj and down_proj of 2 layers
    for scale in (1.0, -2.0):  # the second refresh must follow the changed adapter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.mul_(scale)
        merged.refresh()
        with torch.no_grad():
            expected = model(input_ids=ids).logits.float()
            with merged.swapped():
                got = model(input_ids=ids).logits.float()
            restored = model(input_ids=ids).logits.float()
        with torch.no_grad(), model.disable_adapter():
            plain = model(input_ids=ids).logits.float()
        assert torch.equal(restored, expected)  # weights and adapter back after the swap
        error = ((got - expected).norm() / (expected - plain).norm()).item()
        assert error < 0.05, error  # within bf16 rounding of the adapter's effect


def test_merged_copies_refuse_quantized_or_adapterless_models() -> None:
    from vlmrl.training.rollout.graph_decode import MergedLoRA

    path = ensure_embedded_model("embedded:tiny-qwen3", seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="active LoRA adapter"):
        MergedLoRA(model)



def test_fp8_cache_keeps_the_prefill_in_float8_and_decodes(vl_model) -> None:
    """`kv_cache_dtype: fp8`: the static cache's layers are float8; the prompt's slots hold the
    model-dtype prefill's keys and values clamped and rounded (`stored`), the first token is the
    prefill's own, and decode steps run over the float8 cache (converted on a CPU)."""
    from vlmrl.training.rollout.decode_attention import FP8, FP8_MAX, stored

    model, processor = vl_model
    inputs = vl_inputs(processor, ["What is 2 + 2?", "Name the largest value in the chart now."] * 2)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-5, pad_token_id=0)
    caches, tokens = {}, {}
    for dtype in ("auto", "fp8"):
        decoding = GraphDecoding(model=model, original=model.generate, use_graph=False,
                                 kv_cache_dtype=dtype)
        with torch.no_grad():
            tokens[dtype] = decoding._decode(config, dict(inputs))
        caches[dtype] = next(iter(decoding.decoders.values())).cache
    prompt = inputs["input_ids"].shape[1]
    for exact, rounded in zip(caches["auto"].layers, caches["fp8"].layers):
        assert rounded.keys.dtype == rounded.values.dtype == FP8
        assert torch.equal(rounded.keys[:, :, :prompt].view(torch.uint8),
                           stored(exact.keys[:, :, :prompt], FP8).view(torch.uint8))
        assert torch.equal(rounded.values[:, :, :prompt].view(torch.uint8),
                           stored(exact.values[:, :, :prompt], FP8).view(torch.uint8))
    assert torch.equal(tokens["fp8"][:, :prompt + 1], tokens["auto"][:, :prompt + 1])
    assert tokens["fp8"].shape == tokens["auto"].shape
    assert stored(torch.tensor([1e4, -1e4, 0.5]), FP8).float().tolist() == [FP8_MAX, -FP8_MAX, 0.5]


def test_compiled_step_over_a_float8_cache_decodes_as_the_eager_step(vl_model) -> None:
    """The decode step's forward under torch.compile writes the float8 cache (the compiled
    `index_copy_` of float8 values) and reads it as the eager step does: the same tokens and the
    same cache bytes."""
    model, processor = vl_model
    inputs = vl_inputs(processor, ["What is 2 + 2?", "Name the largest value in the chart now."])
    config = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=-5, pad_token_id=0)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    rest = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    plan = graph_decode.plan_for(config, ids.shape[0], ids.shape[1], ())
    decoders = [GraphDecoder(model, plan, ids.device, [-5], 0, (), use_graph=False,
                             forward=forward, kv_cache_dtype="fp8")
                for forward in (None, torch.compile(model))]
    torch._dynamo.reset()
    with torch.no_grad():
        eager, compiled = (decoder.generate(ids, mask, 20, dict(rest)) for decoder in decoders)
    assert torch.equal(compiled, eager)
    for ours, theirs in zip(decoders[1].cache.layers, decoders[0].cache.layers):
        assert torch.equal(ours.keys.view(torch.uint8), theirs.keys.view(torch.uint8))
        assert torch.equal(ours.values.view(torch.uint8), theirs.values.view(torch.uint8))


def test_fp8_cache_needs_the_grouped_attention_and_graph_decoding(vl_model) -> None:
    from vlmrl.params import ParamsError
    from vlmrl.training.gspo import make_trainer
    from vlmrl.training.rollout.decode_attention import static_cache

    model, processor = vl_model
    inputs = vl_inputs(processor, ["What is 2 + 2?"])
    config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-5, pad_token_id=0)
    decoding = GraphDecoding(model=model, original=model.generate, use_graph=False,
                             attention="model", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 needs the grouped attention"):
        decoding._decode(config, dict(inputs))
    with pytest.raises(ValueError, match="train.kv_cache_dtype must be one of"):
        static_cache(model.config, 64, "int8")
    with pytest.raises(ParamsError, match="kv_cache_dtype: fp8 needs train.graph_decoding"):
        make_trainer(model, processor, None, None, [], generation_rows=None, callbacks=[],
                     graph_decoding="eager", kv_cache_dtype="fp8")


def test_grouped_attention_is_the_language_models_registered_implementation(vl_model,
                                                                            monkeypatch) -> None:
    """Decode steps with `attention="grouped"` run the attention registered with transformers'
    `AttentionInterface`, chosen through the language model's attention implementation alone (the
    vision tower and transformers' "sdpa" entry untouched) and set back afterwards; greedy tokens
    equal `generate`'s."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from vlmrl.training.rollout.decode_attention import GROUPED, attention_implementation

    model, processor = vl_model
    inputs = vl_inputs(processor, ["What is 2 + 2?", "Name the largest value in the chart now."])
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-5, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(**inputs, generation_config=config)
    decoding = GraphDecoding(model=model, original=model.generate, use_graph=False)
    decoding._decode(GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-5,
                                      pad_token_id=0), dict(inputs))  # registers the name
    registered = AttentionInterface._global_mapping[GROUPED]
    decode_steps, during = [], []

    def counting(module, query, *args, **kwargs):
        decode_steps.append(query.shape[2] == 1)
        return registered(module, query, *args, **kwargs)

    def recording(logits, *args):
        during.append((attention_implementation(model), model.config.vision_config._attn_implementation,
                       ALL_ATTENTION_FUNCTIONS["sdpa"]))
        return original(logits, *args)

    original = graph_decode.sample_next
    monkeypatch.setitem(AttentionInterface._global_mapping, GROUPED, counting)
    monkeypatch.setattr(graph_decode, "sample_next", recording)
    with torch.no_grad():
        got = GraphDecoding(model=model, original=model.generate, use_graph=False)._decode(
            config, dict(inputs))
    assert torch.equal(got, expected)
    assert during[0] == ("sdpa", "sdpa", sdpa_attention_forward)  # the prefill's first token
    assert set(during[1:]) == {(GROUPED, "sdpa", sdpa_attention_forward)}
    text_layers = model.config.text_config.num_hidden_layers
    assert decode_steps == [True] * (text_layers * (len(during) - 1))
    assert attention_implementation(model) == "sdpa"


class RecordingNF4:
    """Stands in for an NF4Decode: counts its activations (the CPU model has no NF4 layers to
    swap)."""

    def __init__(self) -> None:
        self.activations = 0

    def __bool__(self) -> bool:
        return True

    @contextlib.contextmanager
    def active(self):
        self.activations += 1
        yield


def test_every_decode_step_activates_the_nf4_projections(vl_model) -> None:
    model, _ = vl_model
    decoding = GraphDecoding(model=model, original=model.generate, use_graph=False,
                             attention="model")
    decoding.nf4 = recording = RecordingNF4()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-5, pad_token_id=0)
    with torch.no_grad():
        out = decoding._decode(config, {"input_ids": torch.tensor([[1, 2, 3]]),
                                        "attention_mask": torch.ones(1, 3, dtype=torch.long)})
    assert out.shape == (1, 7)
    assert recording.activations == 3  # the decode steps after the prefill's first token
