"""Unsloth patches torch and transformers on import and refuses to import without an NVIDIA GPU,
so it lives here and is imported only when the `unsloth` backend is chosen."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def load_unsloth_model(path: str, settings, *, adapter: str | Path | None = None,
                       for_training: bool = False):
    import unsloth  # noqa: F401  (must come before transformers' model classes are used)
    from unsloth import FastVisionModel

    from vlmrl.modeling import load_processor, resolve_dtype

    model, _tokenizer = FastVisionModel.from_pretrained(
        model_name=path,
        load_in_4bit=settings.load_in_4bit,
        dtype=resolve_dtype(settings.dtype),
        max_seq_length=settings.max_seq_length,
        use_gradient_checkpointing="unsloth" if for_training else False,
    )
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=for_training)
    if not for_training:
        FastVisionModel.for_inference(model)
    return model, load_processor(path)


def unsloth_lora(model, lora: Mapping[str, Any], seed: int):
    from unsloth import FastVisionModel

    return FastVisionModel.get_peft_model(
        model,
        finetune_vision_layers=False,
        finetune_language_layers=True,
        finetune_attention_modules=True,
        finetune_mlp_modules=True,
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=list(lora["target_modules"]),
        bias="none",
        random_state=seed,
        use_gradient_checkpointing="unsloth",
    )


def load_unsloth_adapter_model(adapter: str | Path, settings):
    """The adapter loaded by Unsloth itself (base from adapter_config.json): only such a model
    has Unsloth's `save_pretrained_merged`; one attached afterwards with PEFT is refused."""
    import unsloth  # noqa: F401
    from unsloth import FastVisionModel

    from vlmrl.modeling import resolve_dtype

    model, _tokenizer = FastVisionModel.from_pretrained(
        model_name=str(adapter), load_in_4bit=False, dtype=resolve_dtype(settings.dtype),
        max_seq_length=settings.max_seq_length, use_gradient_checkpointing=False)
    return model
