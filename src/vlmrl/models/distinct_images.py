"""A GRPO generation batch holds each prompt's image once per row of its group (num_generations
rows), and TRL's trainer processes a generation batch's images twice: for the prompts' tokens
(`_tokenize_prompts`), then again for the training forward's pixel values. On a host with a
share of a machine's cores that processing is a few percent of a 2B optimizer step
(benchmarks/gspo_step.py --profile-host). So a Qwen-VL image processor here processes each
distinct image of a call once, and a call on images of the call before it takes their pixel
values from it: the output is the plain processor's, row for row (tests/test_distinct_images.py).

Images are the same by their bytes (mode, size and pixels, hashed) or, for the very objects the
call before saw, by identity. Only what one call held is kept for the next: a batch's distinct
images, not the dataset's. The state lives beside the processor, not in its attributes, which
`to_dict` would save."""

from __future__ import annotations

import functools
import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.image_processing_base import BatchFeature
from transformers.image_utils import make_flat_list_of_images

# The outputs of an image processor of the Qwen-VL family: each image's patches, one after the
# other, and its (temporal, height, width) grid, whose product is its count of patches.
OUTPUTS = frozenset({"pixel_values", "image_grid_thw"})


@dataclass
class Kept:
    """One processor's images of its last call (by key: patches and grid, as tensors), the keys
    of the objects it saw (by id: a weak reference and the key), and the array type its plain
    output had for each `return_tensors` it was called with."""

    images: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    seen: dict[int, tuple[weakref.ref, str]] = field(default_factory=dict)
    kinds: dict[Any, type] = field(default_factory=dict)


KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DistinctImages:
    """Before an image processor class in the bases (`distinct_images_class`): `preprocess`
    of a list of PIL images processes each distinct one once and reuses the call before's."""

    def preprocess(self, images: Any, *args: Any, **kwargs: Any) -> BatchFeature:
        flat = pil_images(images)
        if flat is None or args:
            return super().preprocess(images, *args, **kwargs)
        kept = KEPT.setdefault(self, Kept())
        returned = kwargs.get("return_tensors")
        settings = repr(sorted((k, v) for k, v in kwargs.items() if k != "return_tensors"))
        kept.seen = {at: entry for at, entry in kept.seen.items() if entry[0]() is not None}
        keys = [settings + image_key(kept, image) for image in flat]
        fresh = {key: image for key, image in zip(keys, flat) if key not in kept.images}
        if returned is None and returned not in kept.kinds:
            fresh = dict(zip(keys, flat))  # the plain output's array type is not known yet
        available = kept.images
        if fresh:
            processed = super().preprocess(list(fresh.values()), **kwargs)
            if set(processed.keys()) != OUTPUTS:
                kept.images = {}
                return super().preprocess(images, **kwargs)
            kept.kinds[returned] = type(processed["pixel_values"])
            available = {**available, **dict(zip(fresh, per_image(processed)))}
        kept.images = {key: available[key] for key in keys}
        pixels, grids = zip(*(kept.images[key] for key in keys))
        values = {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.stack(grids)}
        if returned is None and kept.kinds[None] is np.ndarray:
            values = {name: value.numpy() for name, value in values.items()}
        return BatchFeature(values, tensor_type=returned)


def image_key(kept: Kept, image) -> str:
    """The image's bytes hashed, or, for an object hashed before (still alive), that hash."""
    known = kept.seen.get(id(image))
    key = known[1] if known is not None and known[0]() is image else content_hash(image)
    kept.seen[id(image)] = (weakref.ref(image), key)
    return key


def content_hash(image) -> str:
    digest = hashlib.blake2b(image.tobytes(), digest_size=16)
    digest.update(f"{image.mode}{image.size}".encode())
    return digest.hexdigest()


def pil_images(images: Any) -> list | None:
    """The flat list of PIL images in a call's `images`, or None where they are anything else
    (arrays, tensors: processed as they are)."""
    from PIL import Image

    try:
        flat = make_flat_list_of_images(images)
    except (TypeError, ValueError):
        return None
    if not flat or not all(isinstance(image, Image.Image) for image in flat):
        return None
    return flat


def per_image(processed: BatchFeature) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each image's (patches, grid) of a Qwen-VL image processor's output, as tensors."""
    pixels, grids = (torch.as_tensor(processed[name]) for name in ("pixel_values",
                                                                    "image_grid_thw"))
    sizes = [int(size) for size in grids.prod(-1)]
    return list(zip(torch.split(pixels, sizes), grids))


@functools.cache
def distinct_images_class(base: type) -> type:
    """`base` with DistinctImages first, under `base`'s own name: saved (`image_processor_type`)
    as `base`, which is what `AutoImageProcessor` and llama.cpp's converter load; pickled by
    reference to this module, where it is kept under that name."""

    class Made(DistinctImages, base):
        __qualname__ = base.__name__

    Made.__name__ = base.__name__
    globals()[base.__name__] = Made
    return Made
