"""The Unsloth backend: the same three jobs as the transformers backend in
`vlmrl.models.loading` (a model for evaluation, the LoRA policy, the 16-bit merge), done by
Unsloth's `FastVisionModel` (`FastLanguageModel` for a text model). Unsloth patches torch,
transformers, PEFT and TRL when imported and refuses to import without an NVIDIA GPU, so
`unsloth` is imported only when this backend is chosen (`UnslothBackend()`), and is this
project's only lazy import of a library."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from peft import PeftModel

from vlmrl.models.backend import resolve_dtype
from vlmrl.models.forward import adapter_and_base_logits, question_inputs
from vlmrl.models.merged_weights import cast_floating_tensors
from vlmrl.models.processor import (
    is_text_checkpoint,
    load_processor,
    save_processing,
    save_with_processor,
    tokenizer_of,
)
from vlmrl.params import LoraParams, ModelParams


class UnslothBackend:
    name = "unsloth"

    def __init__(self) -> None:
        import unsloth  # noqa: F401  (patches torch, transformers, PEFT and TRL on import)

    def load(self, path: str, settings: ModelParams, adapter: Path | str | None = None,
             device: str | None = None) -> tuple[Any, Any]:
        """For inference; `device` is Unsloth's choice (the GPU)."""
        model = self._base(path, settings, for_training=False)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
        fast_model_class(path).for_inference(model)
        return model, load_processor(path)

    def load_policy(self, path: str, settings: ModelParams, lora: LoraParams, seed: int,
                    init_adapter: Path | None = None,
                    model_class: Callable[[type], type] | None = None) -> tuple[Any, Any]:
        """The LoRA policy through Unsloth's own model classes (`model_class` does not apply)."""
        if init_adapter is not None:  # the SFT stage's adapter, continued
            model = PeftModel.from_pretrained(self._base(path, settings, for_training=True),
                                              str(init_adapter), is_trainable=True)
            return model, load_processor(path)
        vision = {} if is_text_checkpoint(path) else {
            "finetune_vision_layers": False, "finetune_language_layers": True,
            "finetune_attention_modules": True, "finetune_mlp_modules": True}
        model = fast_model_class(path).get_peft_model(
            self._base(path, settings, for_training=True),
            **vision,
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",
            random_state=seed,
            use_gradient_checkpointing="unsloth",
        )
        return model, load_processor(path)

    def merge(self, path: str, settings: ModelParams, adapter: Path, row: Mapping,
              out_dir: Path, base_dir: Path) -> tuple[Any, Any]:
        """GPU only. Unsloth's own 16-bit merge where it patched one in, PEFT's otherwise; the
        base is loaded in 16-bit either way, so nothing is merged into 4-bit weights."""
        model, processor = self.load(path, settings)
        save_with_processor(model, processor, base_dir)
        del model
        with tempfile.TemporaryDirectory(prefix="vlmrl-adapter-") as scratch:
            local = adapter_with_base(adapter, path, Path(scratch) / "adapter")
            model = self._adapter_model(local, settings)
        logits = adapter_and_base_logits(model, question_inputs(processor, row))
        if hasattr(model, "save_pretrained_merged"):
            model.save_pretrained_merged(str(out_dir), tokenizer_of(processor),
                                         save_method="merged_16bit")
            cast_floating_tensors(out_dir, settings.dtype)
            save_processing(out_dir, processor)
        else:
            save_with_processor(model.merge_and_unload(), processor, out_dir)
        return logits

    def _base(self, path: str, settings: ModelParams, *, for_training: bool):
        model, _tokenizer = fast_model_class(path).from_pretrained(
            model_name=path,
            load_in_4bit=settings.load_in_4bit,
            dtype=resolve_dtype(settings.dtype),
            max_seq_length=settings.max_seq_length,
            use_gradient_checkpointing="unsloth" if for_training else False,
        )
        return model

    def _adapter_model(self, adapter: Path | str, settings: ModelParams):
        """The adapter loaded by Unsloth itself (base from adapter_config.json, which must name
        a directory or hub id: `adapter_with_base`): only such a model has Unsloth's
        `save_pretrained_merged`; one attached afterwards with PEFT is refused."""
        base = json.loads((Path(adapter) / "adapter_config.json").read_text())["base_model_name_or_path"]
        model, _tokenizer = fast_model_class(base).from_pretrained(
            model_name=str(adapter), load_in_4bit=False, dtype=resolve_dtype(settings.dtype),
            max_seq_length=settings.max_seq_length, use_gradient_checkpointing=False)
        return model


def adapter_with_base(adapter: Path | str, base_path: str, target: Path) -> Path:
    """A copy of the adapter whose adapter_config.json names `base_path` (the directory the base
    was resolved to): a released adapter names its base as a release does (`embedded:...`,
    `vlmrl.models.portable`), which Unsloth, reading the config itself, could not load."""
    shutil.copytree(adapter, target)
    config_path = target / "adapter_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_path
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return target


def fast_model_class(path: str):
    """Unsloth's loader for the checkpoint: FastLanguageModel for a text model, FastVisionModel
    for a vision-language one."""
    from unsloth import FastLanguageModel, FastVisionModel

    return FastLanguageModel if is_text_checkpoint(path) else FastVisionModel
