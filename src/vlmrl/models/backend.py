"""Which backend and which dtype a model runs with: Unsloth where `model.backend` asks for it, or
`auto` finds both CUDA and the package; transformers otherwise. Float32 on a CPU, bf16 (or fp16
where bf16 is unsupported) on a GPU, unless `model.dtype` says otherwise."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
from transformers import BitsAndBytesConfig

from vlmrl.params import ModelParams, ParamsError


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pick_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    has_unsloth = importlib.util.find_spec("unsloth") is not None
    return "unsloth" if has_unsloth and cuda_available() else "transformers"


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        if not cuda_available():
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, name)


def precision_flags(trainer_args: Mapping[str, Any], model_settings: ModelParams) -> dict[str, Any]:
    """A trainer config's device and mixed-precision flags (GSPO's and SFT's alike): CPU where
    there is no GPU, else bf16/fp16 as the model's dtype unless the args set them."""
    if not cuda_available():
        return {"use_cpu": True, "bf16": False, "fp16": False}
    dtype = resolve_dtype(model_settings.dtype)
    return {"bf16": trainer_args.get("bf16", dtype == torch.bfloat16),
            "fp16": trainer_args.get("fp16", dtype == torch.float16)}


def bnb_4bit_config(compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    if not cuda_available():
        raise ParamsError("params.yaml model.load_in_4bit: true needs a CUDA GPU (bitsandbytes)")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def model_device(model) -> torch.device:
    return next(model.parameters()).device
