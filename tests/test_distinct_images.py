"""`vlmrl.models.distinct_images`: a Qwen-VL image processor that processes each distinct image of
a call once and reuses the call before's gives the plain processor's output, and is saved as the
plain one."""

from __future__ import annotations

import copy
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmrl.models.distinct_images import KEPT, DistinctImages, distinct_images_class
from vlmrl.models.embedded import ensure_embedded_model
from vlmrl.models.processor import load_processor


class CountingProcessor(Qwen2VLImageProcessorPil):
    """The plain processor, counting the images it processes."""

    processed = 0

    def preprocess(self, images, *args, **kwargs):
        CountingProcessor.processed += len(images)
        return super().preprocess(images, *args, **kwargs)


@pytest.fixture(scope="module")
def model_dir():
    return ensure_embedded_model("embedded:tiny-qwen3-vl")


def random_image(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def group_batch() -> list[Image.Image]:
    """A generation batch's images: three prompts' images (two sizes), each repeated in four
    rows as copies, as the dataset decodes them afresh for every row."""
    prompts = [random_image(96, 128, 0), random_image(64, 64, 1), random_image(96, 128, 2)]
    return [copy.deepcopy(image) for image in prompts for _ in range(4)]


def assert_same_output(got, expected) -> None:
    assert set(got.keys()) == set(expected.keys()) == {"pixel_values", "image_grid_thw"}
    for name in expected:
        assert type(got[name]) is type(expected[name])
        if isinstance(expected[name], np.ndarray):
            assert got[name].dtype == expected[name].dtype
            assert np.array_equal(got[name], expected[name])
        else:
            assert torch.equal(got[name], expected[name])


@pytest.mark.parametrize("returned", [None, "pt"])
def test_the_output_is_the_plain_processors_row_for_row(model_dir, returned):
    plain = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    distinct = distinct_images_class(Qwen2VLImageProcessorPil).from_pretrained(str(model_dir))
    images = group_batch()
    kwargs = {"return_tensors": returned} if returned else {}
    assert_same_output(distinct(images, **kwargs), plain(images, **kwargs))
    nested = [[image] for image in images]  # one list per prompt, as TRL passes them
    assert_same_output(distinct(nested, **kwargs), plain(nested, **kwargs))


def test_each_distinct_image_once_and_the_next_call_on_the_same_images_none(model_dir):
    distinct = distinct_images_class(CountingProcessor).from_pretrained(str(model_dir))
    images = group_batch()
    CountingProcessor.processed = 0
    first = distinct(images)  # TRL's prompts: no return_tensors
    assert CountingProcessor.processed == 3
    second = distinct(images, return_tensors="pt")  # the training forward's pixel values
    assert CountingProcessor.processed == 3
    assert np.array_equal(second["pixel_values"].numpy(), first["pixel_values"])
    copies = [copy.deepcopy(image) for image in images]  # equal bytes, other objects
    distinct(copies, return_tensors="pt")
    assert CountingProcessor.processed == 3


def test_only_the_last_calls_images_are_kept(model_dir):
    distinct = distinct_images_class(CountingProcessor).from_pretrained(str(model_dir))
    distinct(group_batch())
    assert len(KEPT[distinct].images) == 3
    distinct([random_image(64, 64, 9)])
    assert len(KEPT[distinct].images) == 1
    CountingProcessor.processed = 0
    distinct(group_batch())  # dropped with the call before: processed again
    assert CountingProcessor.processed == 3


def test_other_settings_or_inputs_are_processed_as_they_are(model_dir):
    plain = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    distinct = distinct_images_class(CountingProcessor).from_pretrained(str(model_dir))
    images = group_batch()
    distinct(images)
    CountingProcessor.processed = 0
    smaller = {"max_pixels": 32 * 32 * 4, "return_tensors": "pt"}
    assert_same_output(distinct(images, **smaller), plain(images, **smaller))
    assert CountingProcessor.processed == 3  # another setting: not the kept pixel values
    arrays = [np.asarray(image) for image in images]
    CountingProcessor.processed = 0
    assert_same_output(distinct(arrays, return_tensors="pt"), plain(arrays, return_tensors="pt"))
    assert CountingProcessor.processed == len(arrays)  # not PIL images: all of them


def test_saved_as_the_plain_processor(model_dir, tmp_path):
    processor = load_processor(model_dir)
    assert isinstance(processor.image_processor, DistinctImages)
    processor.image_processor(group_batch())
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["image_processor_type"] == "Qwen2VLImageProcessor"
    assert not any("distinct" in key or "kept" in key for key in saved)
    reloaded = Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    assert_same_output(reloaded(group_batch(), return_tensors="pt"),
                       processor.image_processor(group_batch(), return_tensors="pt"))


def test_pickled_and_loaded_as_itself(model_dir):
    distinct = distinct_images_class(Qwen2VLImageProcessorPil).from_pretrained(str(model_dir))
    images = group_batch()
    again = pickle.loads(pickle.dumps(distinct))
    assert type(again) is type(distinct)
    assert_same_output(again(images, return_tensors="pt"), distinct(images, return_tensors="pt"))
