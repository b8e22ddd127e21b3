"""One loading path for every stage, whatever the model and backend: `backend_for` is the only
place that dispatches on `model.backend`, and each backend does the same three jobs: a model
for evaluation (optionally with the LoRA adapter), the LoRA policy for training (language model
only, never the vision tower), and the 16-bit merge for export. The embedded default resolves to
a local directory and then goes through the same `AutoModelForImageTextToText`/`AutoProcessor`
calls as a hub id (`AutoModelForCausalLM` and the tokenizer for a text model).

The policy may start from the cold-start SFT's adapter (`init_adapter`): it is loaded
trainable and GSPO continues it. The SFT stage's output directory says whether it holds an
adapter (`starting_adapter`): a pass-through SFT leaves the base model as the start."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    set_seed,
)

from vlmrl.models.backend import (
    bnb_4bit_config,
    cuda_available,
    pick_backend,
    process_device,
    repeatable_on_cpu,
    resolve_dtype,
)
from vlmrl.models.embedded import resolve_model_path
from vlmrl.models.forward import adapter_and_base_logits, question_inputs
from vlmrl.models.merged_weights import check_adapter_weights
from vlmrl.models.processor import is_text_checkpoint, load_processor, save_with_processor
from vlmrl.models.unsloth import UnslothBackend
from vlmrl.params import LoraParams, ModelParams, ParamsError

# A subclass factory applied to the model's transformers class before it is loaded (training's
# `vlmrl.training.rollout.generation.rollout_class`).
ModelClass = Callable[[type], type]


class ModelBackend(Protocol):
    name: str

    def load(self, path: str, settings: ModelParams, adapter: Path | str | None = None,
             device: str | None = None) -> tuple[Any, Any]: ...

    def load_policy(self, path: str, settings: ModelParams, lora: LoraParams, seed: int,
                    init_adapter: Path | None = None,
                    model_class: ModelClass | None = None) -> tuple[Any, Any]: ...

    def merge(self, path: str, settings: ModelParams, adapter: Path, row: Mapping,
              out_dir: Path, base_dir: Path) -> tuple[Any, Any]: ...


class TransformersBackend:
    name = "transformers"

    def load(self, path: str, settings: ModelParams, adapter: Path | str | None = None,
             device: str | None = None) -> tuple[Any, Any]:
        model = load_transformers_model(path, settings, device=device)
        if adapter is not None:
            model = attach_adapter(model, adapter)
        return model, load_processor(path)

    def load_policy(self, path: str, settings: ModelParams, lora: LoraParams, seed: int,
                    init_adapter: Path | None = None,
                    model_class: ModelClass | None = None) -> tuple[Any, Any]:
        # 4-bit too goes straight to get_peft_model (which freezes the base; GRPOTrainer enables
        # input gradients for checkpointing). peft's prepare_model_for_kbit_training would upcast
        # every 16-bit tensor to float32, the 0.3 B-parameter embedding and so the logits among
        # them.
        model = load_transformers_model(path, settings, model_class=model_class)
        model.train()
        if init_adapter is not None:
            model = PeftModel.from_pretrained(model, str(init_adapter), is_trainable=True)
            model.train()
            return model, load_processor(path)
        vision = any(".visual." in f".{name}." for name, _ in model.named_modules())
        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=language_model_targets(model, lora.target_modules),
                            exclude_modules=r".*\.visual\..*" if vision else None, bias="none",
                            task_type="CAUSAL_LM")
        return get_peft_model(model, config), load_processor(path)

    def merge(self, path: str, settings: ModelParams, adapter: Path, row: Mapping,
              out_dir: Path, base_dir: Path) -> tuple[Any, Any]:
        check_16bit_checkpoint(path)
        processor = load_processor(path)
        model = load_transformers_model(path, settings)
        save_with_processor(model, processor, base_dir)
        dtype = model.dtype
        # float32 logits on a CPU; on a GPU the model stays 16-bit (an 8B model in float32 would
        # take 32 GB of device memory), and the weight-space check keeps the merge exact.
        model = attach_adapter(model, adapter)
        if not cuda_available():
            model = model.float()
        logits = adapter_and_base_logits(model, question_inputs(processor, row))
        save_with_processor(model.merge_and_unload().to(dtype), processor, out_dir)
        return logits


def backend_for(settings: ModelParams) -> ModelBackend:
    """The backend `model.backend` names (`auto`: Unsloth where CUDA and the package exist).
    Choosing Unsloth imports it, and it must patch TRL before a trainer config is built, so
    train_gspo asks for its backend first."""
    if pick_backend(settings.backend) == "unsloth":
        return UnslothBackend()
    return TransformersBackend()


def load_model(settings: ModelParams, *, adapter: Path | str | None = None,
               device: str | None = None) -> tuple[Any, Any, str]:
    """(model, processor, backend name) for inference; with `adapter`, the LoRA adapter is
    applied."""
    backend = backend_for(settings)
    repeatable_on_cpu()
    model, processor = backend.load(resolve_model_path(settings), settings, adapter, device)
    return model, processor, backend.name


def load_policy(settings: ModelParams, lora: LoraParams, seed: int,
                init_adapter: Path | None = None, *,
                model_class: ModelClass | None = None) -> tuple[Any, Any, str]:
    """(peft model, processor, backend name) with LoRA on the language model only: a fresh
    adapter of `lora`'s shape, or `init_adapter` loaded trainable. `model_class` makes the
    transformers backend load a subclass of the model's class (the Unsloth backend loads its
    own classes and ignores it).

    The global RNGs are seeded first: PEFT draws lora_A from them, and TRL's trainers seed only
    once the model exists, so an unseeded init made two runs of the same params differ."""
    backend = backend_for(settings)
    repeatable_on_cpu()
    set_seed(seed)
    model, processor = backend.load_policy(resolve_model_path(settings), settings, lora, seed,
                                           init_adapter, model_class)
    return model, processor, backend.name


# The SFT stage's output always holds this file; `"adapter": false` marks a pass-through.
START_MARKER = "vlmrl_sft.json"


def write_start_marker(directory: Path, *, adapter: bool, summary: Mapping[str, Any]) -> None:
    payload = {"adapter": adapter, **summary}
    (directory / START_MARKER).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def starting_adapter(sft_out: Path | None) -> Path | None:
    """The adapter GSPO continues and baseline_eval applies (the SFT stage's output), or None
    where there is no SFT output given or the SFT was a pass-through."""
    if sft_out is None:
        return None
    marker = Path(sft_out) / START_MARKER
    if not marker.is_file():
        raise FileNotFoundError(f"{sft_out}: no SFT output ({START_MARKER}) there; the "
                                "sft_cold_start stage makes it")
    return Path(sft_out) if json.loads(marker.read_text(encoding="utf-8")).get("adapter") else None


def sixteen_bit(settings: ModelParams, dtype: str) -> ModelParams:
    return settings.model_copy(update={"dtype": dtype, "load_in_4bit": False})


def merge_adapter(model_settings: ModelParams, dtype: str, adapter: Path, row: Mapping,
                  out_dir: Path, base_dir: Path) -> tuple[Any, Any]:
    """Writes the merged 16-bit model with its processor files to `out_dir`, and the 16-bit base
    it was merged into to `base_dir` (for the base-GGUF control: then only the adapter tells the
    two apart, not bf16 rounding). Returns the adapter model's and the base model's logits on the
    row's image+question."""
    settings = sixteen_bit(model_settings, dtype)
    backend = backend_for(settings)  # Unsloth, when chosen, is imported before CUDA is asked
    repeatable_on_cpu()
    return backend.merge(resolve_model_path(settings), settings, adapter, row, out_dir, base_dir)


def load_merged(merged_dir: Path, dtype: str = "float32") -> tuple[Any, Any]:
    """The merged model and processor, from the directory alone, in float32 by default (exact:
    every value of a 16-bit checkpoint is a float32)."""
    settings = ModelParams(name=str(merged_dir), backend="transformers", dtype=dtype)
    return load_transformers_model(str(merged_dir), settings), load_processor(merged_dir)


# ------------------------------------------------------------------ transformers


def load_transformers_model(path: str, settings: ModelParams, device: str | None = None,
                            model_class: ModelClass | None = None):
    """On this process's device (`process_device`: accelerate's, one GPU per process), or
    `device`; with `model_class`, as `model_class(the checkpoint's class)`."""
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(settings.dtype)}
    if settings.load_in_4bit:
        kwargs["quantization_config"] = bnb_4bit_config(kwargs["dtype"])
    placement = device or process_device()
    if placement is not None:
        kwargs["device_map"] = {"": placement}
    if model_class is None:
        auto = AutoModelForCausalLM if is_text_checkpoint(path) else AutoModelForImageTextToText
        model = auto.from_pretrained(path, **kwargs)
    else:
        model = model_class(checkpoint_class(path)).from_pretrained(path, **kwargs)
    model.eval()
    return model


def checkpoint_class(path: str) -> type:
    """The transformers class that `load_transformers_model` loads the checkpoint as (what
    `AutoModelForCausalLM` or `AutoModelForImageTextToText` picks for its config)."""
    text = is_text_checkpoint(path)
    classes = MODEL_FOR_CAUSAL_LM_MAPPING if text else MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    config = AutoConfig.from_pretrained(path)
    try:
        return classes[type(config)]
    except KeyError:
        kind = "causal language model" if text else "image-text-to-text model"
        raise ParamsError(f"params.yaml model.name: {path} ({type(config).__name__}) is no "
                          f"{kind} transformers can load") from None


def attach_adapter(model, adapter: Path | str) -> PeftModel:
    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter}: no LoRA adapter (adapter_config.json) there; the "
                                "train_gspo stage makes it")
    check_adapter_weights(adapter)
    model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    return model


def language_model_targets(model, names: tuple[str, ...] | list[str]) -> list[str]:
    """Module names that PEFT should adapt: the given projections, never inside the vision tower."""
    wanted = set(names)
    targets = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules()
                      if name.rsplit(".", 1)[-1] in wanted and ".visual." not in f".{name}."})
    missing = sorted(wanted - set(targets))
    if missing:
        raise ParamsError(f"params.yaml train.lora.target_modules {missing} match no module "
                          "of the language model")
    return targets


def check_16bit_checkpoint(path: str) -> None:
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None):
        raise ParamsError(f"{path} is a pre-quantized checkpoint; merging needs the 16-bit base "
                          "weights: point model.name at the 16-bit model for export")
