"""Generation helpers for the GRPO trainer subclass (vlmrl.training.trainer.trainers): a generation batch
generated in chunks of rows (TRL generates the whole batch in one `generate` call, so a static KV
cache is sized for all of it), and whether transformers may compile a bitsandbytes 4-bit model's
decoding (transformers 5.17 never does, although it works with bitsandbytes 0.50). No torch at
import."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from vlmrl.training.trainer.private_names import installed_version

# The versions compiling bitsandbytes 4-bit decoding was measured with (benchmarks/gspo_step.py):
# a later transformers may compile 4-bit models itself, or break in ways forcing it would hide.
BNB_PATCH_VERSIONS = {"transformers": "5.17", "bitsandbytes": "0.50"}

# (prompt_ids, images, multimodal_fields, num_generations, has_tool_images) ->
# (completion_ids, logprobs or None): GRPOTrainer._generate_single_turn's contract.
GenerateRows = Callable[[list, Any, dict, int, bool], tuple[list, Any]]


def generate_in_chunks(generate: GenerateRows, rows: int, prompt_ids: list, images: list | None,
                       fields: dict, num_generations: int,
                       has_tool_images: bool = False) -> tuple[list, list | None]:
    """`generate` over runs of `rows` prompts, the completions (and log-probabilities, where
    every chunk gives them) joined in prompt order."""
    completion_ids: list = []
    logprobs: list | None = []
    for chunk_ids, chunk_images, chunk_fields in split_generation_inputs(
            prompt_ids, images, fields, rows):
        ids, chunk_logprobs = generate(chunk_ids, chunk_images, chunk_fields, num_generations,
                                       has_tool_images)
        completion_ids += ids
        logprobs = None if chunk_logprobs is None or logprobs is None else (
            logprobs + list(chunk_logprobs))
    return completion_ids, logprobs


def split_generation_inputs(prompt_ids: list, images: list | None, fields: dict, rows: int):
    """Yields (prompt_ids, images, multimodal fields) for each run of `rows` prompts. Qwen-VL
    processors flatten every image's patches into one `pixel_values` and give each image a row of
    `image_grid_thw` (t x h x w patches); per-prompt fields are lists with one entry per prompt."""
    count = len(prompt_ids)
    images_per_prompt = [len(found or []) for found in images] if images else [0] * count
    image_start = _offsets(images_per_prompt)
    grid = fields.get("image_grid_thw")
    patch_start = _offsets(grid.prod(-1).tolist() if grid is not None else [])
    for start in range(0, count, rows):
        end = min(start + rows, count)
        first_image, last_image = image_start[start], image_start[end]
        chunk = {}
        for key, value in fields.items():
            if key == "image_grid_thw":
                chunk[key] = value[first_image:last_image]
            elif key == "pixel_values" and grid is not None:
                chunk[key] = value[patch_start[first_image]:patch_start[last_image]]
            elif isinstance(value, list) and len(value) == count:
                chunk[key] = value[start:end]
            else:
                raise ValueError(
                    f"params.yaml `train.max_generation_rows`: cannot split the processor's "
                    f"`{key}` field ({type(value).__name__}) across generation chunks; only "
                    "Qwen-VL image fields and per-prompt lists can be split. Remove the param.")
        yield (prompt_ids[start:end], images[start:end] if images else images, chunk)


def _offsets(sizes: list[int]) -> list[int]:
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + int(size))
    return offsets


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def allow_compiling_bnb_4bit(versions: Mapping[str, str | None] | None = None) -> bool:
    """Whether a bitsandbytes 4-bit model's decoding may be compiled: only under the versions of
    BNB_PATCH_VERSIONS (warns and says no otherwise), and never without bitsandbytes.
    `versions` (package -> installed version or None) defaults to what is installed."""
    if versions is None:
        versions = {package: installed_version(package) for package in BNB_PATCH_VERSIONS}
    if versions.get("bitsandbytes") is None:
        return False  # no 4-bit model can exist
    mismatched = {package: found for package, found in versions.items()
                  if found is None or _major_minor(found) != BNB_PATCH_VERSIONS[package]}
    if mismatched:
        warnings.warn(
            f"not letting transformers compile bitsandbytes 4-bit decoding: the patch was "
            f"written for {BNB_PATCH_VERSIONS}, found {dict(versions)}; 4-bit decoding runs "
            "uncompiled (slower, still correct)", stacklevel=2)
        return False
    return True


def compileable_quantizer(quantizer: Any) -> Any:
    """A copy of a transformers `Bnb4BitHfQuantizer` (same state) whose class lets `generate`
    compile the model's decoding; any other quantizer (or None) comes back as it was."""
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    if not isinstance(quantizer, Bnb4BitHfQuantizer) or quantizer.is_compileable:
        return quantizer
    copy = object.__new__(_compileable_class(type(quantizer)))
    copy.__dict__.update(quantizer.__dict__)
    return copy


@functools.cache
def _compileable_class(base: type) -> type:
    """`base` (the quantizer's class, a subclass of Bnb4BitHfQuantizer) saying it compiles."""

    class Compileable(base):
        @property
        def is_compileable(self) -> bool:
            return True

    Compileable.__name__ = Compileable.__qualname__ = f"Compileable{base.__name__}"
    return Compileable
