"""Which backend and which dtype a model runs with: Unsloth where `model.backend` asks for it, or
`auto` finds both CUDA and the package; transformers otherwise. Float32 on a CPU, bf16 (or fp16
where bf16 is unsupported) on a GPU, unless `model.dtype` says otherwise."""

from __future__ import annotations

import importlib.util

import torch
from transformers import BitsAndBytesConfig

from vlmrl.params import ParamsError


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


def bnb_4bit_config(compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    if not cuda_available():
        raise ParamsError("params.yaml model.load_in_4bit: true needs a CUDA GPU (bitsandbytes)")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def model_device(model) -> torch.device:
    return next(model.parameters()).device
