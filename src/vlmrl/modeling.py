"""One loading path for every stage, whatever the model: the embedded default resolves to a
local directory and then goes through the same `AutoModelForImageTextToText`/`AutoProcessor`
calls as a hub id. Unsloth is imported only inside its backend: it cannot be imported without an
NVIDIA GPU."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.config import ParamsError
from vlmrl.embedded import ensure_embedded_model, is_embedded

BACKENDS = ("auto", "transformers", "unsloth")
DTYPES = ("auto", "float32", "bfloat16", "float16")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>")


@dataclass(frozen=True)
class ModelSettings:
    name: str
    backend: str = "auto"
    dtype: str = "auto"
    load_in_4bit: bool = False
    seed: int = 0
    max_seq_length: int = 4096

    @classmethod
    def from_params(cls, model: Mapping[str, Any]) -> ModelSettings:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(model) - known)
        if unknown:
            raise ParamsError(f"params.yaml `model` has unknown keys {unknown}; known: {sorted(known)}")
        if "name" not in model:
            raise ParamsError("params.yaml `model.name` is missing")
        settings = cls(**model)
        if settings.backend not in BACKENDS:
            raise ParamsError(f"params.yaml `model.backend` is {settings.backend!r}; use one of {BACKENDS}")
        if settings.dtype not in DTYPES:
            raise ParamsError(f"params.yaml `model.dtype` is {settings.dtype!r}; use one of {DTYPES}")
        return settings


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pick_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    has_unsloth = importlib.util.find_spec("unsloth") is not None
    return "unsloth" if has_unsloth and cuda_available() else "transformers"


def resolve_dtype(name: str):
    import torch

    if name == "auto":
        if not cuda_available():
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, name)


def resolve_model_path(settings: ModelSettings) -> str:
    """A local directory for the embedded model; hub ids and local paths pass through."""
    if is_embedded(settings.name):
        return str(ensure_embedded_model(settings.name, seed=settings.seed))
    return settings.name


def load_processor(path: str | Path):
    """`AutoProcessor`, or a Qwen3-VL processor without its video part where torchvision is
    missing (there `AutoProcessor` silently returns a bare tokenizer)."""
    from transformers import AutoProcessor

    if importlib.util.find_spec("torchvision") is None:
        return _image_only_processor(path)
    processor = AutoProcessor.from_pretrained(str(path))
    if getattr(processor, "image_processor", None) is not None:
        return processor
    return _image_only_processor(path)


def _image_only_processor(path: str | Path):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from vlmrl.processor import ImageOnlyQwen3VLProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    return ImageOnlyQwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     chat_template=tokenizer.chat_template)


def vision_token_ids(processor) -> list[int]:
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = [tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS]
    return [i for i in ids if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id]


def suppressed_generation_kwargs(processor) -> dict[str, Any]:
    """Generation must never emit vision tokens: a completion holding `<|image_pad|>` breaks the
    next forward pass ("Image features and image tokens do not match")."""
    return {"suppress_tokens": vision_token_ids(processor)}


def load_model(settings: ModelSettings, *, adapter: str | Path | None = None,
               for_training: bool = False, device: str | None = None):
    """Returns (model, processor, backend). With `adapter`, the LoRA adapter is applied."""
    backend = pick_backend(settings.backend)
    path = resolve_model_path(settings)
    if backend == "unsloth":
        from vlmrl.unsloth_backend import load_unsloth_model

        model, processor = load_unsloth_model(path, settings, adapter=adapter,
                                              for_training=for_training)
        return model, processor, backend
    model = load_transformers_model(path, settings, device=device)
    processor = load_processor(path)
    if adapter is not None:
        model = attach_adapter(model, adapter)
    return model, processor, backend


def load_transformers_model(path: str, settings: ModelSettings, device: str | None = None):
    from transformers import AutoModelForImageTextToText

    kwargs: dict[str, Any] = {"dtype": resolve_dtype(settings.dtype)}
    if settings.load_in_4bit:
        kwargs["quantization_config"] = bnb_4bit_config(kwargs["dtype"])
        kwargs["device_map"] = {"": 0}
    elif device or cuda_available():
        kwargs["device_map"] = {"": device or 0}
    model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    model.eval()
    return model


def bnb_4bit_config(compute_dtype):
    if not cuda_available():
        raise ParamsError("params.yaml `model.load_in_4bit: true` needs a CUDA GPU (bitsandbytes)")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def attach_adapter(model, adapter: str | Path):
    from peft import PeftModel

    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{adapter}: no LoRA adapter (adapter_config.json) there; the train_gspo stage makes it")
    model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    return model


def model_device(model):
    return next(model.parameters()).device
