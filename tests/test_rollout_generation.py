"""Training's rollouts reach their own decoding through the class the policy is loaded as
(`vlmrl.training.rollout.generation.rollout_class`): TRL's call on the PEFT model must arrive at the
decoding that was set, the plain class must keep transformers' `generate`, and the top-k sampler
on a CPU must give what `generate` gives with the sampler's keyword arguments."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from vlmrl.models.embedded import resolve_model_path
from vlmrl.models.loading import load_policy, load_transformers_model
from vlmrl.models.sampling import SamplingSettings, sampling_kwargs
from vlmrl.params import LoraParams, ModelParams
from vlmrl.training.rollout.generation import (
    RolloutGeneration,
    rollout_class,
    rollout_model,
    sample_top_k_on_cpu,
)

MODEL = ModelParams(name="embedded:tiny-qwen3-vl")
LORA = LoraParams(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def policy():
    model, processor, _ = load_policy(MODEL, LORA, 0, model_class=rollout_class)
    model.eval()
    processor.tokenizer.padding_side = "left"
    inputs = dict(processor.tokenizer(["Two plus two is", "The longer question here is"],
                                      return_tensors="pt", padding=True))
    return model, inputs


def test_rollout_class_keeps_the_name_module_and_transformers_generate(policy) -> None:
    model, inputs = policy
    inner = rollout_model(model)
    base = type(inner).__mro__[2]
    assert isinstance(inner, RolloutGeneration) and isinstance(inner, base)
    assert (type(inner).__name__, type(inner).__module__) == (base.__name__, base.__module__)
    assert rollout_class(base) is type(inner)  # one class per model class
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-5, pad_token_id=0)
    plain = load_transformers_model(resolve_model_path(MODEL), MODEL)
    assert type(plain) is base
    with torch.no_grad(), model.disable_adapter():
        ours = model.generate(**inputs, generation_config=config)
        theirs = plain.generate(**inputs, generation_config=config)
    assert torch.equal(ours, theirs)


def test_peft_generate_reaches_the_decoding_set_and_can_go_back(policy) -> None:
    model, inputs = policy
    inner = rollout_model(model)
    seen = []

    def decoding(*args, **kwargs):
        seen.append(sorted(kwargs))
        return inner.transformers_generate(*args, **kwargs)

    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-5, pad_token_id=0)
    inner.set_rollout_generate(decoding)
    try:
        with torch.no_grad():
            routed = model.generate(**inputs, generation_config=config)
    finally:
        inner.set_rollout_generate(None)
    with torch.no_grad():
        direct = model.generate(**inputs, generation_config=config)
    assert seen == [["attention_mask", "generation_config", "input_ids"]]
    assert torch.equal(routed, direct) and len(seen) == 1


def test_top_k_on_cpu_samples_as_generate_with_the_samplers_arguments(policy) -> None:
    model, inputs = policy
    settings = SamplingSettings(temperature=0.9, top_k=20, top_p=0.8)
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.9, top_k=20,
                              top_p=0.8, eos_token_id=-5, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(0)
        expected = model.generate(**inputs, generation_config=config, **sampling_kwargs(settings))
        assert sample_top_k_on_cpu(model, settings) is True
        try:
            torch.manual_seed(0)
            got = model.generate(**inputs, generation_config=config)  # as TRL calls it
        finally:
            rollout_model(model).set_rollout_generate(None)
    assert torch.equal(got, expected)
    assert sample_top_k_on_cpu(model, None) is False


def test_a_plain_class_is_refused_with_the_fix_named() -> None:
    plain, _, _ = load_policy(MODEL, LORA, 0)
    with pytest.raises(TypeError, match=r"model_class=vlmrl.training.rollout.generation.rollout_class"):
        sample_top_k_on_cpu(plain, SamplingSettings(1.0, 20))


def test_a_checkpoint_of_no_loadable_kind_is_named(tmp_path) -> None:
    """The class a policy is loaded as comes from transformers' public model mappings; a
    checkpoint in none of them is one line naming model.name, not a KeyError."""
    import transformers

    from vlmrl.models.loading import checkpoint_class
    from vlmrl.params import ParamsError

    transformers.ViTConfig().save_pretrained(tmp_path)
    with pytest.raises(ParamsError, match=r"^params\.yaml model\.name: .* \(ViTConfig\) is no "):
        checkpoint_class(str(tmp_path))
