"""The processor every stage feeds the model through, its chat template, and how it is saved.

Qwen3-VL's processor insists on a video processor, and video processors need torchvision, which
has no CPU build here. Images are all this project feeds the model, so where torchvision is
missing `ImageOnlyQwen3VLProcessor` keeps Qwen3-VL's image and text handling and leaves video
out. Processors are always saved the hub's way, so `AutoProcessor` (where torchvision exists) and
llama.cpp's converter read every directory the project writes. Generation never emits vision
tokens: a completion holding `<|image_pad|>` breaks the next forward pass."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
from pathlib import Path
from typing import Any

from transformers import AutoProcessor, AutoTokenizer, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>")


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.vision_start_token = "<|vision_start|>"
        self.vision_end_token = "<|vision_end|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def save_pretrained(self, save_directory, **kwargs):
        """Saved the hub way (preprocessor_config.json etc.), never as this class's name."""
        save_processor_files(save_directory, self.image_processor, self.tokenizer)
        return []


def load_processor(path: str | Path):
    """`AutoProcessor`, or a Qwen3-VL processor without its video part where torchvision is
    missing (there `AutoProcessor` silently returns a bare tokenizer)."""
    if importlib.util.find_spec("torchvision") is None:
        return _image_only_processor(path)
    processor = AutoProcessor.from_pretrained(str(path))
    if getattr(processor, "image_processor", None) is not None:
        return processor
    return _image_only_processor(path)


def _image_only_processor(path: str | Path) -> ImageOnlyQwen3VLProcessor:
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


def chat_template() -> str:
    """Qwen3-VL's chat template, shipped with the package."""
    assets = importlib.resources.files("vlmrl") / "assets"
    return (assets / "qwen3_vl_chat_template.jinja").read_text()


def save_processor_files(out_dir: Path | str, image_processor, tokenizer) -> None:
    """Writes the processor as a hub Qwen3-VL repo lays it out, so `AutoProcessor` where
    torchvision exists, and llama.cpp's `--mmproj` converter, both read it."""
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    preprocessor = out_dir / "preprocessor_config.json"
    config = json.loads(preprocessor.read_text())
    config["processor_class"] = "Qwen3VLProcessor"
    preprocessor.write_text(json.dumps(config, indent=2) + "\n")
    video = {key: config[key] for key in ("patch_size", "temporal_patch_size", "merge_size",
                                           "image_mean", "image_std")}
    video.update(video_processor_type="Qwen3VLVideoProcessor", processor_class="Qwen3VLProcessor",
                 size={"shortest_edge": 4096, "longest_edge": 25165824}, fps=2, min_frames=4,
                 max_frames=768, do_sample_frames=True)
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    template = tokenizer.chat_template or chat_template()
    (out_dir / "chat_template.jinja").write_text(template)


def save_with_processor(model, processor, out_dir: Path) -> None:
    """safetensors plus tokenizer, chat template and image processor: a directory that
    AutoModelForImageTextToText, AutoProcessor and llama.cpp's converter each read alone."""
    model.save_pretrained(out_dir)
    save_processor_files(out_dir, processor.image_processor, processor.tokenizer)
