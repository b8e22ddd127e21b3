"""A generation batch keeps every row's pixel values until its last micro-batch is trained: in
the processor's float32, each row with its own copy of its group's image, so the 2B recipe's
generation of 32 rows of 512-pixel images holds about 200 MB of them through the training
micro-batches, where its step's memory peaks. Qwen-VL models cast pixel values to their vision
tower's dtype before any arithmetic (`get_image_features`), so kept in that dtype they give the
same logits, in half the memory on a bfloat16 policy."""

from __future__ import annotations

from typing import Any

import torch

# model_type of the models whose image features start with `pixel_values.type(visual.dtype)`
CASTING_MODELS = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


def tower_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype `model` (under a PEFT wrapper too) casts pixel values to before its vision tower
    reads them, for the models known to (CASTING_MODELS); None for any other."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(base, "config", None), "model_type", None) not in CASTING_MODELS:
        return None
    visual = getattr(getattr(base, "model", base), "visual", None)
    return None if visual is None else visual.dtype


def pixels_in(batch: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """`batch` with its floating-point `pixel_values` in `dtype` (as it is where `dtype` is None
    or the batch has none)."""
    pixels = batch.get("pixel_values")
    if (dtype is None or not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point()
            or pixels.dtype == dtype):
        return batch
    return {**batch, "pixel_values": pixels.to(dtype)}
