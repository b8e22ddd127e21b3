"""Which backend and which dtype a model runs with: Unsloth where `model.backend` names it,
transformers + PEFT otherwise (`auto` too: `pick_backend` says why). Float32 on a CPU, bf16 (or
fp16 where bf16 is unsupported) on a GPU, unless `model.dtype` says otherwise."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import BitsAndBytesConfig

from vlmrl.params import ModelParams, ParamsError


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pick_backend(requested: str) -> str:
    """`auto` is transformers + PEFT, Unsloth installed or not: it was faster on every model
    measured on an H100, the tiny default (a learning run per seed in about 140 s against
    Unsloth's 380 s, `benchmarks/learning.py`) and Qwen3-VL-2B's shape (the GSPO step benchmark's
    profile about 6x Unsloth's speed at a lower peak), docs/benchmarks.md. Unsloth runs where
    `model.backend: unsloth` names it."""
    return "transformers" if requested == "auto" else requested


def avoid_cudnn_attention() -> None:
    """Turns off PyTorch's cuDNN backend of `scaled_dot_product_attention` (a public switch);
    SDPA then picks flash or memory-efficient attention. On Hopper GPUs its backward returns NaN
    in the query gradient when an attention mask is passed, the sequence length is 64 more than
    a multiple of 128 and a row's log-sum-exp is below about -88.7 (pytorch/pytorch#196678,
    huggingface/trl#7181); transformers bf16 training on data seed 7 hit it at GSPO step 7 on an
    H100 (CHANGELOG.md, Fixed). Training calls this before a trainer is built; the forward pass,
    which evaluation uses, is not affected."""
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)


def repeatable_on_cpu() -> None:
    """Makes a CPU run repeatable to the bit on one machine. MKL, torch's BLAS on a CPU, may use
    fewer threads than asked when the machine is busy (its dynamic mode), and so sum a matrix
    product in another order; setting the thread count, even to the one torch chose, turns that
    off. Ops with a nondeterministic CPU kernel take their deterministic one. On a GPU nothing
    changes: its kernels' order varies by design (tests/gpu/README.md)."""
    if cuda_available():
        return
    torch.set_num_threads(torch.get_num_threads())
    torch.use_deterministic_algorithms(True, warn_only=True)


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


def mixed_precision(trainer_args: Mapping[str, Any], model_settings: ModelParams) -> str:
    """`accelerate launch --mixed_precision` for a launched run: what `precision_flags` give the
    one-process trainer, so both paths train in the same precision."""
    flags = precision_flags(trainer_args, model_settings)
    return "bf16" if flags["bf16"] else "fp16" if flags["fp16"] else "no"


def process_device() -> int | None:
    """The index of the GPU accelerate gives this process (its local rank; 0 alone), or None on a
    CPU and where ZeRO-3 or FSDP shard the weights themselves (they load on the CPU first)."""
    sharded = (os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
               or os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3")
    if not cuda_available() or sharded:
        return None
    from accelerate import PartialState

    device = PartialState().device  # alone: "cuda", no index
    return device.index if device.index is not None else torch.cuda.current_device()


def bnb_4bit_config(compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    if not cuda_available():
        raise ParamsError("params.yaml model.load_in_4bit: true needs a CUDA GPU (bitsandbytes)")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def model_device(model) -> torch.device:
    return next(model.parameters()).device
