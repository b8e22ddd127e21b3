"""`vlmrl.models.image_features` on the tiny Qwen3-VL: a model whose vision tower keeps its
images' features gives the plain model's logits and adapter gradients, encodes each image once
per generation (a prefill of distinct images, then micro-batches of repeated and reordered ones),
lets one generation's images go at the next's prefill, runs the tower itself where it is
trained, and is put back as it was."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tiny_batches import tiny_lora_policy

from vlmrl.errors import ParamsError
from vlmrl.models.image_features import (
    KeptImageFeatures,
    kept_image_features,
    plain_call,
    vision_tower_path,
)


@pytest.fixture(scope="module")
def tiny():
    model, processor = tiny_lora_policy(torch.float32)
    return model.train(), processor


def image(index: int) -> Image.Image:
    return Image.new("RGB", (64 + 32 * (index % 2), 64), (40 * index, 90, 200 - 30 * index))


def batch(processor, images: list[int]) -> dict[str, torch.Tensor]:
    """One row per entry of `images` (an image index each), left-padded prompts."""
    processor.tokenizer.padding_side = "left"
    texts = [processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x" * (1 + i)}]}],
        add_generation_prompt=True, tokenize=False) for i in range(len(images))]
    return dict(processor(text=texts, images=[image(i) for i in images], return_tensors="pt",
                          padding=True))


def logits_and_grads(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach(), {name: param.grad.clone() for name, param in model.named_parameters()
                             if param.requires_grad}


def test_kept_features_give_the_plain_models_logits_and_gradients(tiny):
    model, processor = tiny
    prefill, micro_batches = batch(processor, [0, 1, 2]), [batch(processor, images) for images
                                                           in ([2, 0, 0, 1], [1, 1, 2, 0])]
    plain = [logits_and_grads(model, inputs) for inputs in micro_batches]
    with kept_image_features(model) as tower:
        with torch.no_grad():
            model(**prefill)
        assert tower.encoded == 3
        kept = [logits_and_grads(model, inputs) for inputs in micro_batches]
        assert tower.encoded == 3  # every micro-batch's images were the prefill's
    for (logits, grads), (kept_logits, kept_grads) in zip(plain, kept):
        torch.testing.assert_close(kept_logits, logits, rtol=1e-5, atol=1e-5)
        assert grads.keys() == kept_grads.keys()
        for name in grads:
            torch.testing.assert_close(kept_grads[name], grads[name], rtol=1e-4, atol=1e-6)


def test_the_next_generations_prefill_lets_the_kept_images_go(tiny):
    model, processor = tiny
    with kept_image_features(model) as tower, torch.no_grad():
        model(**batch(processor, [0, 1]))
        model(**batch(processor, [1, 2]))  # one kept, one new: added
        assert (tower.encoded, len(tower.kept)) == (3, 3)
        model(**batch(processor, [3, 4]))  # only new images: the next generation
        assert (tower.encoded, len(tower.kept)) == (5, 2)
        model(**batch(processor, [0]))
        assert tower.encoded == 6


def test_a_trained_tower_encodes_every_call_and_the_tower_is_put_back(tiny):
    model, processor = tiny
    path = vision_tower_path(model)
    original = model.get_submodule(path)
    parameter = next(original.parameters())
    parameter.requires_grad_(True)
    try:
        with kept_image_features(model) as tower, torch.no_grad():
            assert isinstance(model.get_submodule(path), KeptImageFeatures)
            assert tower.dtype == original.dtype
            for _ in range(2):
                model(**batch(processor, [0, 1]))
            assert (tower.encoded, tower.kept) == (0, [])
    finally:
        parameter.requires_grad_(False)
    assert model.get_submodule(path) is original


def test_a_model_without_such_a_tower_is_refused_by_its_param():
    with pytest.raises(ParamsError, match="train.keep_image_features"):
        vision_tower_path(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize(("options", "plain"), [
    ({}, True),
    ({"return_dict": True, "use_cache": False, "output_attentions": False,
      "output_hidden_states": None}, True),
    ({"output_attentions": True}, False),
    ({"output_hidden_states": True}, False),
    ({"return_dict": False}, False),
    ({"cu_seqlens": torch.zeros(2)}, False)])
def test_only_calls_for_the_features_alone_are_served(options: dict, plain: bool):
    assert plain_call(options) is plain


class PlainTower(torch.nn.Module):
    """A tower whose output has no deepstack features (not Qwen3-VL's), counting its calls."""

    spatial_merge_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.deepstack_merger_list = torch.nn.ModuleList()
        self.calls = 0

    def forward(self, hidden_states, grid_thw, **kwargs):
        self.calls += 1
        return hidden_states * 2


def test_a_tower_without_deepstack_features_runs_once_a_call_and_is_not_served_again():
    tower = PlainTower()
    wrapper = KeptImageFeatures(tower)
    patches, grid = torch.ones(8, 3), torch.tensor([[1, 2, 4]])
    for calls in (1, 2):
        assert torch.equal(wrapper(patches, grid, return_dict=True), patches * 2)
        assert (tower.calls, wrapper.serves, wrapper.encoded) == (calls, False, 0)


def test_the_trainer_mixin_keeps_images_while_it_trains_and_reports_its_counts(tiny, capsys):
    from vlmrl.training.trainer.mixins import KeptImagesInTraining

    model, processor = tiny
    path = vision_tower_path(model)
    original = model.get_submodule(path)

    class Trainer:  # what the mixin needs of TRL's trainer: `model` and `train`
        def __init__(self, model) -> None:
            self.model = model

        def train(self) -> None:
            assert isinstance(self.model.get_submodule(path), KeptImageFeatures)
            with torch.no_grad():
                for images in ([0, 1], [1, 0, 1]):
                    self.model(**batch(processor, images))

    trainer = type("Trained", (KeptImagesInTraining, Trainer), {})(
        model=model, keep_image_features=True)
    trainer.train()
    assert trainer.images_encoded == {"encoded": 2, "asked": 5}
    assert "the vision tower encoded 2 of the 5 images" in capsys.readouterr().out
    assert model.get_submodule(path) is original
