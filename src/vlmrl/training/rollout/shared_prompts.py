"""Each distinct prompt prefilled once. TRL repeats every prompt `num_generations`
times in a generation batch, so a prefill of 16 rows runs the vision tower and the language
model over 4 prompts 4 times each, and its activations are most of the generation's peak
memory beside the KV cache (measured: benchmarks/decode_profile.py). Here the distinct rows
(same token ids, same images) are prefilled into a small cache, whose keys and values are then
copied into every row of the static cache that repeats them; the first token is still drawn
per row. Rows are told apart by their ids and, for each image, its patches and grid."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch

from vlmrl.training.rollout.decode_attention import stored

PER_IMAGE = ("pixel_values", "image_grid_thw")  # indexed by image, not by row


def distinct_rows(input_ids: torch.Tensor, model_kwargs: dict[str, Any],
                  vision_start: int | None) -> tuple[list[int], torch.Tensor] | None:
    """(the first row of each distinct prompt, each row's index among them), or None where the
    rows can't be told apart safely (videos, an input this does not know) or all differ."""
    rows = input_ids.shape[0]
    if set(model_kwargs) - {*PER_IMAGE, "mm_token_type_ids"}:
        return None
    if "pixel_values" in model_kwargs and (vision_start is None
                                           or "image_grid_thw" not in model_kwargs):
        return None
    images = _images_by_row(input_ids, model_kwargs, vision_start)
    keep: list[int] = []
    inverse = []
    for row in range(rows):
        same = next((i for i, kept in enumerate(keep)
                     if torch.equal(input_ids[row], input_ids[kept])
                     and _same_images(images[row], images[kept])), None)
        if same is None:
            keep.append(row)
            same = len(keep) - 1
        inverse.append(same)
    if len(keep) == rows:
        return None
    return keep, torch.tensor(inverse, device=input_ids.device)


def _images_by_row(input_ids, model_kwargs, vision_start) -> list[list[tuple]]:
    """Per row, its images as (grid, patches)."""
    if "pixel_values" not in model_kwargs:
        return [[] for _ in range(input_ids.shape[0])]
    pixels, grids = model_kwargs["pixel_values"], model_kwargs["image_grid_thw"]
    counts = (input_ids == vision_start).sum(-1).tolist()
    starts = list(accumulate(grids.prod(-1).tolist(), initial=0))
    found, image = [], 0
    for count in counts:
        found.append([(grids[i], pixels[starts[i]:starts[i + 1]])
                      for i in range(image, image + count)])
        image += count
    return found


def _same_images(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(torch.equal(ga, gb) and torch.equal(pa, pb)
                                    for (ga, pa), (gb, pb) in zip(a, b))


def select_rows(keep: list[int], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                model_kwargs: dict[str, Any], vision_start: int | None):
    """The inputs of the rows `keep` alone: ids, mask and keyword arguments."""
    picked = torch.tensor(keep, device=input_ids.device)
    kwargs = {key: value.index_select(0, picked) for key, value in model_kwargs.items()
              if key not in PER_IMAGE}
    if "pixel_values" in model_kwargs:
        images = _images_by_row(input_ids, model_kwargs, vision_start)
        chosen = [image for row in keep for image in images[row]]
        kwargs["pixel_values"] = torch.cat([patches for _, patches in chosen])
        kwargs["image_grid_thw"] = torch.stack([grid for grid, _ in chosen])
    return input_ids.index_select(0, picked), attention_mask.index_select(0, picked), kwargs


@torch.no_grad()
def copy_into_static(small, static, inverse: torch.Tensor, length: int) -> None:
    """Every row of the static cache gets its prompt's keys and values from `small` (a cache of
    the distinct rows, `length` slots filled); the next slot written is `length`. Each layer of
    `small` is emptied once copied, so the two caches are never whole at once (the peak)."""
    for source, target in zip(small.layers, static.layers):
        keys, values = source.keys.index_select(0, inverse), source.values.index_select(0, inverse)
        source.keys = source.values = None
        if not target.is_initialized:
            target.lazy_initialization(keys, values)
        target.keys[:, :, :length].copy_(stored(keys, target.keys.dtype))
        target.values[:, :, :length].copy_(stored(values, target.values.dtype))
        target.cumulative_length.fill_(length)
